"""Two ranks on one GPU over gloo with CUDA tensors: TP2 and EP2 forward/backward against TP1.

    torchrun --standalone --nproc_per_node=2 gloo_cuda_layouts.py RESULTS.json WORKDIR [--layouts tp2,ep2]

One GPU cannot host two NCCL ranks, but gloo moves CUDA tensors for the collectives it implements
(all-reduce, broadcast, all-gather, all-to-all), so tensor and expert parallelism can run with both
ranks on cuda:0. The reference is the same model at TP1 (DP2, both ranks hold everything), saved as
a distributed checkpoint and loaded into each layout. Per layout, against the reference:
log-probs and entropies of the same micro-batches (forward), then three optimizer steps of the
actor loss with the plain optimizer (backward: gradients through every collective), then three
critic steps with the distributed optimizer (reduce-scatter/all-gather of the grad buffers).
The tiny GLM-flavoured MoE and the step helpers are tests/component/mp_scripts/megatron_layouts.py's,
so the CPU suite and this check compare the same things. Without CUDA it runs on the CPU (gloo, the
CPU shims): that is how its plumbing is tested here.

RESULTS.json (rank 0, rewritten after every part, so a hang keeps what finished): a list of
``{"layout", "status" (PASS/FAIL/SKIP), "detail", numbers...}``. A collective gloo does not implement
for CUDA tensors gives SKIP with gloo's message, not FAIL.
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
from sao_megatron.training.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from sao_megatron.parallel.bootstrap import init_distributed  # noqa: E402

LAYOUTS = {
    "ref": ParallelConfig(),
    # Megatron refuses MoE with TP > 1 without sequence parallelism (reduce-scatter/all-gather on TP).
    "tp2": ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    "ep2": ParallelConfig(expert_model_parallel_size=2),
}
LOGPROB_TOL = 1e-4
"""fp32 on both sides; TP splits the matmuls' reductions across ranks (summation order only)."""
LOSS_REL_TOL = 1e-4
"""Three Adam steps on fp32 weights; a wrong gradient anywhere moves the losses by far more."""
UNSUPPORTED = ("not supported", "unsupported", "not implemented", "does not support")


def environ() -> dict[str, str]:
    """Both ranks on cuda:0 (LOCAL_RANK picks the device in init_distributed)."""
    return dict(os.environ, LOCAL_RANK="0")


def context(name: str, *, distributed_optimizer: bool):
    parallel = dataclasses.replace(LAYOUTS[name], use_distributed_optimizer=distributed_optimizer)
    return init_distributed(parallel, seed=ml.SEED, environ=environ())


def microbatches(device: torch.device) -> list[dict[str, torch.Tensor]]:
    return [{k: v.to(device) for k, v in mb.items()} for mb in ml.microbatches()]


def forward_part(name: str, workdir: str, mbs, ref: dict) -> dict:
    ctx = context(name, distributed_optimizer=False)
    actor = ml.build_model_chunks(ml.MODEL, ctx)
    if name == "ref":
        save_checkpoint(f"{workdir}/actor", actor)
    else:
        load_checkpoint(f"{workdir}/actor", actor)
    on = {str(p.device) for c in actor for p in c.parameters()}
    outs = [(o["lp"], o["ent"]) for o in ml.logprob_outputs(actor, mbs, ctx)]
    if name == "ref":
        ref["lp"] = outs
    lp_diff = max(float((a - b).abs().max()) for (a, _), (b, _) in zip(outs, ref["lp"]))
    ent_diff = max(float((a - b).abs().max()) for (_, a), (_, b) in zip(outs, ref["lp"]))
    losses = ml.actor_losses(actor, mbs, ctx)
    if name == "ref":
        ref["actor_losses"] = losses
    ok_losses = all(math.isclose(a, b, rel_tol=LOSS_REL_TOL) for a, b in zip(losses, ref["actor_losses"]))
    ok = lp_diff < LOGPROB_TOL and ent_diff < LOGPROB_TOL and ok_losses and losses[0] > losses[-1]
    return {"layout": name, "status": "PASS" if ok else "FAIL", "params_on": sorted(on),
            "backend": dist.get_backend(), "logprob_maxdiff": lp_diff, "actor_losses": losses,
            "detail": (f"{ctx.world_size} ranks on {','.join(sorted(on))} over {dist.get_backend()}: max |Δlogp| "
                       f"{lp_diff:.1e}, |Δentropy| {ent_diff:.1e} vs TP1 (tol {LOGPROB_TOL:g}); actor losses "
                       + " ".join(f"{x:.5f}" for x in losses) + " vs TP1 " + " ".join(
                           f"{x:.5f}" for x in ref["actor_losses"]) + f" (rel tol {LOSS_REL_TOL:g})")}


def critic_part(name: str, workdir: str, mbs, ref: dict) -> dict:
    ctx = context(name, distributed_optimizer=True)
    actor = ml.build_model_chunks(ml.MODEL, ctx)
    load_checkpoint(f"{workdir}/actor", actor)
    results = {k: {} for k in ("frozen_changed", "trainable_unchanged", "num_frozen", "num_trainable")}
    losses = ml.critic_run(actor, mbs, ctx, results, name, check_frozen=True)
    if name == "ref":
        ref["critic_losses"] = losses
    ok = (all(math.isclose(a, b, rel_tol=LOSS_REL_TOL) for a, b in zip(losses, ref["critic_losses"]))
          and not results["frozen_changed"][name] and not results["trainable_unchanged"][name])
    return {"layout": f"{name} critic", "status": "PASS" if ok else "FAIL", "critic_losses": losses,
            "detail": ("distributed optimizer, frozen attention: value losses " + " ".join(
                f"{x:.5f}" for x in losses) + " vs TP1 " + " ".join(f"{x:.5f}" for x in ref["critic_losses"])
                + f"; frozen params changed {len(results['frozen_changed'][name])}, trainable unchanged "
                f"{len(results['trainable_unchanged'][name])}")}


def attempt(fn, label: str, *args) -> dict:
    """Run one part; gloo's 'not supported' for a CUDA collective is a SKIP with its message."""
    try:
        return fn(*args)
    except Exception as exc:
        msg = str(exc).splitlines()[0][:240]
        unsupported = any(s in str(exc).lower() for s in UNSUPPORTED)
        return {"layout": label, "status": "SKIP" if unsupported else "FAIL",
                "detail": ("gloo does not implement a collective this needs for CUDA tensors: " if unsupported
                           else f"{type(exc).__name__}: ") + msg}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results")
    parser.add_argument("workdir")
    parser.add_argument("--layouts", default="tp2,ep2")
    parser.add_argument("--no-critic", action="store_true")
    parser.add_argument("--hang-timeout", type=float, default=170.0)
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.hang_timeout, exit=True)
    dist.init_process_group("gloo")  # before init_distributed, which then keeps it (NCCL needs one GPU per rank)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    mbs, ref, rows = microbatches(device), {}, []
    names = ["ref"] + [n for n in args.layouts.split(",") if n in LAYOUTS and n != "ref"]
    parts = [(forward_part, n) for n in names] + ([] if args.no_critic else [(critic_part, n) for n in names])
    for fn, name in parts:
        row = attempt(fn, name if fn is forward_part else f"{name} critic", name, args.workdir, mbs, ref)
        rows.append(row)
        if dist.get_rank() == 0:
            pathlib.Path(args.results).write_text(json.dumps(rows, indent=1))
        if row["status"] != "PASS" and name == "ref":
            break  # no reference: the layouts have nothing to compare with
    ml.destroy()


if __name__ == "__main__":
    main()
