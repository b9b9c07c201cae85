"""TP2 and TP2xEP2 forward/backward on the GPU(s) against TP1, with the layout that ran asserted.

    python tp_ep_layouts.py RESULTS.json WORKDIR --ref-only            # TP1 reference, one process
    torchrun --standalone --nproc_per_node=2 tp_ep_layouts.py RESULTS.json WORKDIR --backend nccl|gloo

Layouts: the reference (TP1) runs in its own single process; the two-rank layouts are ``tp2``
(TP2, sequence parallel) and ``tp2_ep2`` (TP2, EP2, expert-TP 1, sequence parallel: experts split
over the two ranks, dense layers over TP), both with DP 1. Every row records the tp/ep/dp sizes,
backend and devices the ranks really used; the caller asserts them.

Backends: ``nccl`` (two GPUs, one rank per GPU: what production uses), or gloo without CUDA (CPU
tensors, CPU shims: how its plumbing is tested here). Not gloo with CUDA tensors on one GPU: DP 1
does not avoid Megatron's coalesced collectives (DDP's gradient sync calls ``allreduce_coalesced``
at any DP size, the distributed optimizer ``reduce_scatter_tensor_coalesced`` and
``allgather_into_tensor_coalesced``), which gloo implements for CPU tensors only, and gloo refuses
the expert-TP dispatcher's uneven ``all_gather`` (the first H200 run, issue 37). gpu_check.sh
reports the check as not applicable below 2 GPUs.

Per layout, against the reference: log-probs and entropies of the same micro-batches (forward),
three actor optimizer steps (plain optimizer: gradients through every collective), three critic
steps with the distributed optimizer. The tiny MoE and the step helpers are
tests/component/mp_scripts/megatron_layouts.py's. RESULTS.json (rank 0, rewritten after every
part): a list of ``{"layout", "status" (PASS/FAIL), "detail", sizes, numbers...}``; the reference
run writes WORKDIR/ref.json and the checkpoint the layouts load. Any exception is a FAIL.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import math
import os
import pathlib
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "component" / "mp_scripts"))
import megatron_layouts as ml  # noqa: E402

from sao_megatron.config.schema import ParallelConfig  # noqa: E402
from sao_megatron.parallel.bootstrap import init_distributed  # noqa: E402
from sao_megatron.training.run.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402

LAYOUTS = {
    "ref": ParallelConfig(),
    # Megatron refuses MoE with TP > 1 without sequence parallelism (reduce-scatter/all-gather on TP).
    "tp2": ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    "tp2_ep2": ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                              expert_tensor_parallel_size=1, sequence_parallel=True),
}
EXPECTED_SIZES = {"tp2": {"tp": 2, "ep": 1, "dp": 1}, "tp2_ep2": {"tp": 2, "ep": 2, "dp": 1, "expt_dp": 1}}
"""What each two-rank layout must have run with."""
LOGPROB_TOL = 1e-4
"""fp32 on both sides; TP splits the matmuls' reductions across ranks (summation order only)."""
LOSS_REL_TOL = 1e-4
"""Three Adam steps on fp32 weights; a wrong gradient anywhere moves the losses by far more."""


def context(name: str, *, distributed_optimizer: bool, backend: str):
    parallel = dataclasses.replace(LAYOUTS[name], use_distributed_optimizer=distributed_optimizer)
    # gloo runs without CUDA only (main refuses it with CUDA): LOCAL_RANK then picks nothing.
    env = dict(os.environ, LOCAL_RANK="0") if backend == "gloo" else None
    return init_distributed(parallel, seed=ml.SEED, environ=env)


def sizes(ctx) -> dict:
    return {"tp": ctx.tp_size, "ep": ctx.ep_size, "dp": ctx.dp_size, "expt_dp": ctx.expt_dp_size,
            "world": ctx.world_size, "backend": dist.get_backend()}


def forward_part(name: str, args, mbs, ref: dict) -> dict:
    ctx = context(name, distributed_optimizer=False, backend=args.backend)
    actor = ml.build_model_chunks(ml.MODEL, ctx)
    if name == "ref":
        save_checkpoint(f"{args.workdir}/actor", actor)
    else:
        load_checkpoint(f"{args.workdir}/actor", actor)
    on = sorted({str(p.device) for c in actor for p in c.parameters()})
    outs = [(o["lp"].cpu(), o["ent"].cpu()) for o in ml.logprob_outputs(actor, mbs, ctx)]
    losses = ml.actor_losses(actor, mbs, ctx)
    if name == "ref":
        return {"layout": name, "status": "PASS", "lp": [a.tolist() for a, _ in outs],
                "ent": [b.tolist() for _, b in outs], "actor_losses": losses, "params_on": on, **sizes(ctx)}
    lp_diff = max(float((a - torch.tensor(b)).abs().max()) for (a, _), b in zip(outs, ref["lp"]))
    ent_diff = max(float((a - torch.tensor(b)).abs().max()) for (_, a), b in zip(outs, ref["ent"]))
    ok_losses = all(math.isclose(a, b, rel_tol=LOSS_REL_TOL) for a, b in zip(losses, ref["actor_losses"]))
    ok = lp_diff < LOGPROB_TOL and ent_diff < LOGPROB_TOL and ok_losses and losses[0] > losses[-1]
    got = sizes(ctx)
    return {"layout": name, "status": "PASS" if ok else "FAIL", "params_on": on, **got,
            "logprob_maxdiff": lp_diff, "actor_losses": losses,
            "detail": (f"tp {got['tp']} ep {got['ep']} dp {got['dp']} over {got['backend']} on {','.join(on)}: "
                       f"max |Δlogp| {lp_diff:.1e}, |Δentropy| {ent_diff:.1e} vs TP1 (tol {LOGPROB_TOL:g}); "
                       "actor losses " + " ".join(f"{x:.5f}" for x in losses) + " vs TP1 "
                       + " ".join(f"{x:.5f}" for x in ref["actor_losses"]) + f" (rel tol {LOSS_REL_TOL:g})")}


def critic_part(name: str, args, mbs, ref: dict) -> dict:
    ctx = context(name, distributed_optimizer=True, backend=args.backend)
    actor = ml.build_model_chunks(ml.MODEL, ctx)
    load_checkpoint(f"{args.workdir}/actor", actor)
    results = {k: {} for k in ("frozen_changed", "trainable_unchanged", "num_frozen", "num_trainable")}
    losses = ml.critic_run(actor, mbs, ctx, results, name, check_frozen=True)
    if name == "ref":
        return {"layout": "ref critic", "status": "PASS", "critic_losses": losses, **sizes(ctx)}
    ok = (all(math.isclose(a, b, rel_tol=LOSS_REL_TOL) for a, b in zip(losses, ref["critic_losses"]))
          and not results["frozen_changed"][name] and not results["trainable_unchanged"][name])
    return {"layout": f"{name} critic", "status": "PASS" if ok else "FAIL", "critic_losses": losses, **sizes(ctx),
            "detail": ("distributed optimizer, frozen attention: value losses " + " ".join(
                f"{x:.5f}" for x in losses) + " vs TP1 " + " ".join(f"{x:.5f}" for x in ref["critic_losses"])
                + f"; frozen params changed {len(results['frozen_changed'][name])}, trainable unchanged "
                f"{len(results['trainable_unchanged'][name])}")}


def attempt(fn, label: str, *args) -> dict:
    """Run one part; any exception is a FAIL with its message (gloo's "unsupported device type"
    included: never a SKIP)."""
    try:
        return fn(*args)
    except Exception as exc:
        msg = str(exc).splitlines()[0][:240] if str(exc) else ""
        return {"layout": label, "status": "FAIL", "detail": f"{type(exc).__name__}: {msg}"}


def run_reference(args, mbs) -> int:
    ref = attempt(forward_part, "ref", "ref", args, mbs, {})
    critic = attempt(critic_part, "ref critic", "ref", args, mbs, {}) if ref["status"] == "PASS" else None
    rows = [ref] + ([critic] if critic else [])
    pathlib.Path(args.results).write_text(json.dumps(rows, indent=1))
    if any(r["status"] != "PASS" for r in rows):
        return 1
    pathlib.Path(args.workdir, "ref.json").write_text(json.dumps(ref | {"critic_losses": critic["critic_losses"]}))
    return 0


def run_layouts(args, mbs) -> int:
    ref = json.loads(pathlib.Path(args.workdir, "ref.json").read_text())
    rows = []
    for fn, name in [(forward_part, n) for n in args.layouts] + [(critic_part, n) for n in args.layouts]:
        rows.append(attempt(fn, name if fn is forward_part else f"{name} critic", name, args, mbs, ref))
        if dist.is_initialized() and dist.get_rank() == 0:
            pathlib.Path(args.results).write_text(json.dumps(rows, indent=1))
    return int(any(r["status"] != "PASS" for r in rows))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("results")
    parser.add_argument("workdir")
    parser.add_argument("--ref-only", action="store_true", help="write the TP1 reference (one process)")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="gloo")
    parser.add_argument("--layouts", default="tp2,tp2_ep2")
    parser.add_argument("--hang-timeout", type=float, default=170.0)
    args = parser.parse_args()
    args.layouts = [n for n in args.layouts.split(",") if n in EXPECTED_SIZES]
    faulthandler.dump_traceback_later(args.hang_timeout, exit=True)
    cuda = torch.cuda.is_available()
    if cuda and args.backend == "gloo" and not args.ref_only:
        raise SystemExit("tp_ep_layouts.py: --backend gloo with CUDA tensors cannot run Megatron's coalesced "
                         "collectives (see the module docstring): use --backend nccl with 2 GPUs")
    if not args.ref_only and (args.backend == "gloo" or not cuda):
        dist.init_process_group("gloo")  # before init_distributed, which then keeps it
    local = int(os.environ.get("LOCAL_RANK", "0")) if args.backend == "nccl" else 0
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    mbs = [{k: v.to(device) for k, v in mb.items()} for mb in ml.microbatches()]
    rc = run_reference(args, mbs) if args.ref_only else run_layouts(args, mbs)
    ml.destroy()
    return rc


if __name__ == "__main__":
    sys.exit(main())
