"""Multi-rank Megatron checks in one torchrun launch (each process imports torch+megatron once).

    torchrun --nproc_per_node=4 megatron_layouts.py RESULTS.json WORKDIR

For several parallel layouts of the same tiny GLM-flavoured MoE model (weights
written once at the reference layout TP1/PP1/EP1 and loaded through the same
distributed checkpoint), records on rank 0 into RESULTS.json:
- log-probs/entropies vs the reference layout (max abs difference);
- actor losses over a few optimizer steps (-mean log-prob);
- critic value losses over a few steps, with the distributed and the plain optimizer;
- frozen critic parameters that changed / trainable ones that did not (all ranks);
- a critic+optimizer checkpoint saved at one layout and resumed at another.
The assertions (with tolerances) live in tests/component/test_megatron_parallel.py.
Every rank sees the same micro-batches; losses divide by the DP size so all layouts optimise
the same objective.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from sao_megatron.config.schema import CriticConfig, ModelConfig, OptimizerConfig, ParallelConfig
from sao_megatron.models.actor import token_logprobs
from sao_megatron.models.builder import build_model_chunks
from sao_megatron.models.critic import freeze_for_critic, init_critic_from_actor, token_values
from sao_megatron.training.run.checkpoint import load_checkpoint, save_checkpoint
from sao_megatron.parallel.bootstrap import destroy, init_distributed
from sao_megatron.training.step.forward import forward_backward
from sao_megatron.training.step.optim import setup_optimizer, optimizer_step

MODEL = ModelConfig(
    family="glm4_moe", num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
    num_query_groups=2, kv_channels=8, num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
    moe_shared_expert_intermediate_size=32, moe_layer_freq=[0, 1, 1, 1], moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, add_qkv_bias=True,
    rotary_percent=0.5, vocab_size=100, max_position_embeddings=64)
"""vocab 100 is padded to 128 (TP1) / 256 (TP2): log-probs must ignore the padding."""

LAYOUTS = {
    "ref": ParallelConfig(),
    "tp2_ep2_sp": ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True),
    "pp2": ParallelConfig(pipeline_model_parallel_size=2),
    "ep2_dp2": ParallelConfig(expert_model_parallel_size=2),
    "pp2_vpp2_tp2_sp": ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                      tensor_model_parallel_size=2, sequence_parallel=True),
}
STEPS = 3
SEED = 1234
T0 = time.time()


def log(msg: str) -> None:
    """Progress on stderr (the test prints it when a launch fails or hangs)."""
    print(f"[{time.time() - T0:6.1f}s rank{os.environ.get('RANK', '0')}] {msg}", file=sys.stderr, flush=True)


def microbatches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for seq in (16, 12):
        tokens = torch.randint(0, MODEL.vocab_size, (2, seq), generator=g)
        out.append({"tokens": tokens, "returns": torch.randn(2, seq, generator=g),
                    "mask": (torch.rand(2, seq, generator=g) > 0.2).float()})
    return out


def layout(name: str, *, distributed_optimizer: bool = True) -> ParallelConfig:
    return dataclasses.replace(LAYOUTS[name], use_distributed_optimizer=distributed_optimizer)


def gather_names(names: list[str]) -> list[str]:
    out: list[list[str]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(out, names)
    return sorted({f"rank{r}:{n}" for r, ns in enumerate(out) for n in ns})


def logprob_outputs(chunks, mbs, ctx) -> list[dict[str, torch.Tensor]]:
    def loss_fn(logits, mb):
        lp, ent = token_logprobs(logits, mb["tokens"], tp_group=ctx.tp_group, vocab_size=MODEL.vocab_size)
        return logits.new_zeros(()), {"lp": lp, "ent": ent}

    return forward_backward(chunks, mbs, loss_fn, ctx=ctx, forward_only=True)


def broadcast_last_stage(value, ctx):
    """Rank 0 records results; with PP they live on the last stage."""
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_world_size() - 1)
    return box[0]


def actor_losses(chunks, mbs, ctx) -> list[float]:
    ddp, opt, sched = setup_optimizer(chunks, OptimizerConfig(lr=3e-3), ctx, total_steps=STEPS)
    num_tokens = sum(float(mb["mask"].sum()) for mb in mbs) * ctx.dp_size

    def loss_fn(logits, mb):
        lp, _ = token_logprobs(logits, mb["tokens"], tp_group=ctx.tp_group, vocab_size=MODEL.vocab_size)
        loss = -(lp * mb["mask"]).sum() / num_tokens
        return loss, {"loss": loss.detach()}

    return _train(ddp, opt, sched, mbs, loss_fn, ctx)


def _train(ddp, opt, sched, mbs, loss_fn, ctx, steps: int = STEPS) -> list[float]:
    losses = []
    for _ in range(steps):
        result = optimizer_step(ddp, opt, sched, mbs, loss_fn, ctx=ctx)
        losses.append(sum(float(m["loss"]) for m in result.outputs) * ctx.dp_size)
    return broadcast_last_stage(losses if ctx.is_last_stage else None, ctx)


def critic_setup(actor_chunks, ctx, *, resume_from: str | None = None):
    critic = build_model_chunks(MODEL, ctx, value_head=True)
    init_critic_from_actor(critic, actor_chunks)
    freeze_for_critic(critic, CriticConfig().trainable)
    ddp, opt, sched = setup_optimizer(critic, OptimizerConfig(lr=1e-2), ctx, total_steps=10)
    if resume_from:
        load_checkpoint(resume_from, ddp, opt)
    return critic, ddp, opt, sched


def value_loss_fn(mbs, ctx):
    num_tokens = sum(float(mb["mask"].sum()) for mb in mbs) * ctx.dp_size

    def loss_fn(out, mb):
        loss = 0.5 * (((token_values(out) - mb["returns"]) ** 2) * mb["mask"]).sum() / num_tokens
        return loss, {"loss": loss.detach()}
    return loss_fn


def critic_run(actor_chunks, mbs, ctx, results, key: str, *, check_frozen: bool) -> list[float]:
    critic, ddp, opt, sched = critic_setup(actor_chunks, ctx)
    # Chunk index in the name: with VPP each chunk numbers its local layers from 0.
    params = [(f"chunk{i}.{n}", p) for i, c in enumerate(critic) for n, p in c.named_parameters()]
    before = {n: p.detach().clone() for n, p in params}
    losses = _train(ddp, opt, sched, mbs, value_loss_fn(mbs, ctx), ctx)
    if check_frozen:
        results["frozen_changed"][key] = gather_names(
            [n for n, p in params if not p.requires_grad and not torch.equal(before[n], p.detach())])
        results["trainable_unchanged"][key] = gather_names(
            [n for n, p in params if p.requires_grad and torch.equal(before[n], p.detach())])
        results["num_frozen"][key] = sum(1 for n, p in params if not p.requires_grad)
        results["num_trainable"][key] = sum(1 for n, p in params if p.requires_grad)
    return losses


def run_layout(name: str, workdir: str, mbs, results, ref) -> None:
    t0 = time.time()
    log(f"layout {name}")
    ctx = init_distributed(layout(name), seed=SEED)
    actor = build_model_chunks(MODEL, ctx)
    if name == "ref":
        save_checkpoint(f"{workdir}/actor", actor)
    else:
        load_checkpoint(f"{workdir}/actor", actor)
    log(f"{name}: weights ready")
    outs = [(o["lp"], o["ent"]) for o in logprob_outputs(actor, mbs, ctx)]  # [] before the last stage
    outs = broadcast_last_stage(outs if ctx.is_last_stage else None, ctx)
    if name == "ref":
        ref["lp"] = outs
        results["ref_logprob_mean"] = float(sum(lp.mean() for lp, _ in outs))
    results["logprob_maxdiff"][name] = max(float((a - b).abs().max()) for (a, _), (b, _) in zip(outs, ref["lp"]))
    results["entropy_maxdiff"][name] = max(float((a - b).abs().max()) for (_, a), (_, b) in zip(outs, ref["lp"]))
    log(f"{name}: log-probs done")
    results["critic_losses"][name] = critic_run(actor, mbs, ctx, results, name, check_frozen=True)
    log(f"{name}: critic done")
    results["actor_losses"][name] = actor_losses(actor, mbs, ctx)
    log(f"{name}: actor done")
    if name in ("ref", "ep2_dp2"):
        ctx = init_distributed(layout(name, distributed_optimizer=False), seed=SEED)
        plain_actor = build_model_chunks(MODEL, ctx)
        load_checkpoint(f"{workdir}/actor", plain_actor)
        results["critic_losses_plain_optimizer"][name] = critic_run(plain_actor, mbs, ctx, results, name,
                                                                    check_frozen=False)
    results["seconds"][name] = time.time() - t0


def run_resume(workdir: str, mbs, results) -> None:
    """2 critic steps at TP2×EP2+SP, save critic+optimizer; resume at TP1 EP2 DP4 for the 3rd step.

    (Optimizer state reshards between layouts that both have EP > 1: see training.run.checkpoint.)
    """
    ctx = init_distributed(layout("tp2_ep2_sp"), seed=SEED)
    actor = build_model_chunks(MODEL, ctx)
    load_checkpoint(f"{workdir}/actor", actor)
    critic, ddp, opt, sched = critic_setup(actor, ctx)
    first = _train(ddp, opt, sched, mbs, value_loss_fn(mbs, ctx), ctx, steps=2)
    save_checkpoint(f"{workdir}/critic", ddp, opt, extra={"steps": 2})
    ctx = init_distributed(layout("ep2_dp2"), seed=SEED)
    actor = build_model_chunks(MODEL, ctx)
    load_checkpoint(f"{workdir}/actor", actor)
    critic, ddp, opt, sched = critic_setup(actor, ctx)
    extra = load_checkpoint(f"{workdir}/critic", ddp, opt)
    sched.step(increment=extra["steps"])
    results["resume_losses"] = first + _train(ddp, opt, sched, mbs, value_loss_fn(mbs, ctx), ctx, steps=1)
    results["resume_extra"] = extra


def main(out_path: str, workdir: str, only: list[str] | None = None) -> None:
    results = {k: {} for k in ("logprob_maxdiff", "entropy_maxdiff", "critic_losses", "critic_losses_plain_optimizer",
                               "actor_losses", "frozen_changed", "trainable_unchanged", "num_frozen",
                               "num_trainable", "seconds")}
    mbs, ref = microbatches(), {}
    for name in ["ref"] + [n for n in (only or LAYOUTS) if n in LAYOUTS and n != "ref"]:
        run_layout(name, workdir, mbs, results, ref)
    if only is None or "resume" in only:
        run_resume(workdir, mbs, results)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    destroy()


if __name__ == "__main__":  # dist checkpoint saving starts a multiprocessing manager
    parser = argparse.ArgumentParser()
    parser.add_argument("results")
    parser.add_argument("workdir")
    parser.add_argument("--only", default=None, help="comma-separated layouts (+ 'resume'); ref always runs")
    parser.add_argument("--hang-timeout", type=float, default=540.0, help="dump stacks and exit after this")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.hang_timeout, exit=True)
    main(args.results, args.workdir, args.only.split(",") if args.only else None)
