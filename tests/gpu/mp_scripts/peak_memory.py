"""Peak GPU memory of one actor or critic training step, for comparison with `sao-megatron plan`.

    python peak_memory.py CONFIG.yaml OUT.json [--role actor|critic|both]

Each role runs in its own process (``--role both`` starts two), so nothing the other role
allocated, and no allocator state, is left over. Per role: the model of CONFIG (bf16 params,
Megatron DDP with fp32 grads, the configured optimizer), two optimizer steps on one micro-batch
of ``max_tokens_per_microbatch`` tokens in rows of ``data.max_total_tokens`` (the second step has
the Adam state resident, as every step of a run does). Records torch.cuda.max_memory_allocated
(tensors only: the allocator's cache and the CUDA context are not in the plan's per-role numbers).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

GIB = 2**30


def one_role(config: str, role: str) -> dict:
    from sao_megatron.config import load_config
    from sao_megatron.models.actor import token_logprobs
    from sao_megatron.models.builder import build_model_chunks, count_parameters
    from sao_megatron.models.critic import freeze_for_critic, token_values
    from sao_megatron.parallel.bootstrap import destroy, init_distributed
    from sao_megatron.training.step.optim import setup_optimizer, optimizer_step

    cfg = load_config(config)
    ctx = init_distributed(cfg.parallel, seed=0)
    part = cfg.actor if role == "actor" else cfg.critic
    chunks = build_model_chunks(cfg.model, ctx, value_head=role == "critic", recompute=part.recompute_granularity)
    if role == "critic":
        freeze_for_critic(chunks, cfg.critic.trainable)
    ddp, opt, sched = setup_optimizer(chunks, part.optimizer, ctx, total_steps=10)
    seq = cfg.data.max_total_tokens
    rows = part.max_tokens_per_microbatch // seq
    g = torch.Generator().manual_seed(0)
    mb = {"tokens": torch.randint(0, cfg.model.vocab_size, (rows, seq), generator=g).to(ctx.device),
          "returns": torch.randn(rows, seq, generator=g).to(ctx.device)}
    num_tokens = float(rows * seq)

    def actor_loss(logits, mb):
        lp, _ = token_logprobs(logits, mb["tokens"], tp_group=ctx.tp_group, vocab_size=cfg.model.vocab_size)
        loss = -lp.sum() / num_tokens
        return loss, {"loss": loss.detach()}

    def critic_loss(values, mb):
        loss = 0.5 * ((token_values(values) - mb["returns"]) ** 2).sum() / num_tokens
        return loss, {"loss": loss.detach()}

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    losses = [float(optimizer_step(ddp, opt, sched, [mb], actor_loss if role == "actor" else critic_loss,
                               ctx=ctx).outputs[0]["loss"]) for _ in range(2)]
    torch.cuda.synchronize()
    counts = count_parameters(chunks)
    out = {f"{role}_peak_gib": torch.cuda.max_memory_allocated() / GIB,
           f"{role}_detail": (f"{counts['total'] / 1e6:.0f}M params ({counts['trainable'] / 1e6:.0f}M trainable), "
                              f"micro-batch {rows}x{seq}, {cfg.model.params_dtype}, step {1e3 * (time.perf_counter() - t0) / 2:.0f} ms, "
                              f"loss {losses[0]:.3f} -> {losses[1]:.3f}")}
    destroy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("out")
    parser.add_argument("--role", choices=["actor", "critic", "both"], default="both")
    args = parser.parse_args()
    if args.role != "both":
        result = one_role(args.config, args.role)
    else:
        result = {}
        for role in ("actor", "critic"):
            part = f"{args.out}.{role}"
            subprocess.run([sys.executable, __file__, args.config, part, "--role", role], check=True)
            with open(part) as f:
                result |= json.load(f)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
