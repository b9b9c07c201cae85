"""Actor and critic on CUDA as production runs them: bf16 params, fp32 grads, distributed optimizer.

    python megatron_cuda.py RESULTS.json

One process (world 1). The tiny GLM-flavoured MoE of tests/component/mp_scripts/megatron_layouts.py
is built twice on the device: in fp32 (the reference) and in bf16 with the fp32 weights copied in.
Recorded for tests/gpu/test_megatron_cuda.py:
- where parameters, gradient buffers and the value head live and in which dtype;
- bf16 vs fp32 log-probs on the same micro-batches;
- the bf16 model's fp32 main gradients vs the fp32 model's gradients of the same loss (cosine,
  relative error): the backward in bf16 must point the same way;
- actor losses over optimizer steps with the distributed optimizer (a fixed batch: must fall);
- critic (value head, frozen attention) losses over steps with the distributed optimizer and with
  the plain one, and which parameters moved.
Without CUDA it runs on the CPU (the CPU shims): only to test its plumbing.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "component" / "mp_scripts"))
import megatron_layouts as ml  # noqa: E402

from sao_megatron.config.schema import CriticConfig, OptimizerConfig, ParallelConfig  # noqa: E402
from sao_megatron.models.actor import token_logprobs  # noqa: E402
from sao_megatron.models.builder import build_model_chunks  # noqa: E402
from sao_megatron.models.critic import freeze_for_critic, init_critic_from_actor  # noqa: E402
from sao_megatron.parallel.bootstrap import destroy, init_distributed  # noqa: E402
from sao_megatron.training.step.forward import compute_logprobs, compute_values, forward_backward  # noqa: E402
from sao_megatron.training.step.optim import setup_optimizer, optimizer_step, zero_grads  # noqa: E402

BF16 = dataclasses.replace(ml.MODEL, params_dtype="bf16")
STEPS = 5


def microbatches(device):
    return [{k: v.to(device) for k, v in mb.items()} for mb in ml.microbatches()]


def actor_loss_fn(mbs, ctx):
    num_tokens = sum(float(mb["mask"].sum()) for mb in mbs)

    def loss_fn(logits, mb):
        lp, _ = token_logprobs(logits, mb["tokens"], tp_group=ctx.tp_group, vocab_size=ml.MODEL.vocab_size)
        loss = -(lp * mb["mask"]).sum() / num_tokens
        return loss, {"loss": loss.detach()}
    return loss_fn


def flat_main_grads(chunks) -> torch.Tensor:
    """Every parameter's fp32 main gradient (Megatron DDP's buffer), in name order."""
    named = sorted((n, p) for c in chunks for n, p in c.named_parameters() if p.requires_grad)
    return torch.cat([p.main_grad.detach().float().flatten() for _, p in named])


def placement(chunks) -> dict:
    params = [p for c in chunks for p in c.parameters()]
    return {"param_devices": sorted({str(p.device) for p in params}),
            "param_dtypes": sorted({str(p.dtype) for p in params}),
            "main_grad_dtypes": sorted({str(p.main_grad.dtype) for p in params if hasattr(p, "main_grad")}),
            "main_grad_devices": sorted({str(p.main_grad.device) for p in params if hasattr(p, "main_grad")})}


def gradients(chunks, mbs, ctx, opt_cfg) -> tuple[list, object, object, torch.Tensor]:
    """DDP-wrap + optimizer, one forward/backward of the actor loss; returns (ddp, opt, sched, grads)."""
    ddp, opt, sched = setup_optimizer(chunks, opt_cfg, ctx, total_steps=STEPS + 1)
    zero_grads(ddp, opt)
    forward_backward(ddp, mbs, actor_loss_fn(mbs, ctx), ctx=ctx)
    return ddp, opt, sched, flat_main_grads(chunks)


def actor_part(ctx, mbs, out: dict):
    fp32 = build_model_chunks(ml.MODEL, ctx)
    bf16 = build_model_chunks(BF16, ctx)
    with torch.no_grad():
        for (n32, p32), (n16, p16) in zip(fp32[0].named_parameters(), bf16[0].named_parameters(), strict=True):
            assert n32 == n16, (n32, n16)
            p16.copy_(p32)
    lp32 = compute_logprobs(fp32, mbs, ctx=ctx, vocab_size=ml.MODEL.vocab_size)
    lp16 = compute_logprobs(bf16, mbs, ctx=ctx, vocab_size=ml.MODEL.vocab_size)
    out["logprob_bf16_vs_fp32_maxdiff"] = max(float(((a - b) * mb["mask"]).abs().max())
                                               for a, b, mb in zip(lp16, lp32, mbs))
    opt_cfg = OptimizerConfig(lr=3e-3)
    _, _, _, g32 = gradients(fp32, mbs, ctx, opt_cfg)
    ddp, opt, sched, g16 = gradients(bf16, mbs, ctx, opt_cfg)
    out["grad_cosine"] = float(torch.nn.functional.cosine_similarity(g16, g32, dim=0))
    out["grad_rel_err"] = float((g16 - g32).norm() / g32.norm())
    out["actor"] = placement(bf16)
    out["actor_optimizer"] = type(opt).__name__ if not hasattr(opt, "chained_optimizers") else \
        [type(o).__name__ for o in opt.chained_optimizers]
    loss_fn = actor_loss_fn(mbs, ctx)
    out["actor_losses"] = [float(sum(m["loss"] for m in optimizer_step(ddp, opt, sched, mbs, loss_fn, ctx=ctx).outputs))
                           for _ in range(STEPS)]
    return bf16


def critic_losses(actor, mbs, ctx, *, distributed: bool, out: dict, key: str) -> None:
    critic = build_model_chunks(BF16, ctx, value_head=True)
    init_critic_from_actor(critic, actor)
    freeze_for_critic(critic, CriticConfig().trainable)
    head = critic[0].output_layer
    out[f"{key}_value_head"] = sorted({f"{p.device}/{p.dtype}" for p in head.parameters()})
    # setup_optimizer takes the optimizer kind from the layout.
    ctx = dataclasses.replace(ctx, parallel=dataclasses.replace(ctx.parallel, use_distributed_optimizer=distributed))
    ddp, opt, sched = setup_optimizer(critic, OptimizerConfig(lr=1e-2), ctx, total_steps=STEPS)
    params = [(n, p) for c in critic for n, p in c.named_parameters()]
    before = {n: p.detach().clone() for n, p in params}
    loss_fn = ml.value_loss_fn(mbs, ctx)
    out[f"{key}_losses"] = [float(sum(m["loss"] for m in optimizer_step(ddp, opt, sched, mbs, loss_fn, ctx=ctx).outputs))
                            for _ in range(STEPS)]
    out[f"{key}_frozen_changed"] = [n for n, p in params if not p.requires_grad and not torch.equal(before[n], p)]
    out[f"{key}_trainable_unchanged"] = [n for n, p in params if p.requires_grad and torch.equal(before[n], p)]
    out[f"{key}_num_trainable"] = sum(p.requires_grad for _, p in params)
    out[f"{key}"] = placement(critic)
    out[f"{key}_values_device"] = str(compute_values(critic, mbs[:1], ctx=ctx)[0].device)


def main(out_path: str) -> None:
    ctx = init_distributed(ParallelConfig(use_distributed_optimizer=True), seed=ml.SEED)
    mbs = microbatches(ctx.device)
    out = {"device": str(ctx.device), "cuda": torch.cuda.is_available()}
    actor = actor_part(ctx, mbs, out)
    critic_losses(actor, mbs, ctx, distributed=True, out=out, key="critic")
    critic_losses(actor, mbs, ctx, distributed=False, out=out, key="critic_plain")
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    destroy()


if __name__ == "__main__":
    main(sys.argv[1])
