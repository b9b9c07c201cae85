"""Exercise every CPU shim once; with ``--skip NAME`` that shim is left out and the run must fail.

    python shim_probe.py WORKDIR [--skip NAME]                  # world 1: TP1
    torchrun --nproc_per_node=4 shim_probe.py WORKDIR [--skip NAME]  # TP2 x EP2 (expert-TP 2) + SP

Covers: model build (alltoall dispatcher streams), RNG tracker seeding, forward/backward through
Megatron's schedules, DDP + distributed optimizer step, optimizer checkpoint save + load into a
fresh optimizer, expert dispatch over EP/expert-TP groups. Prints OK and exits 0 on success.
"""

from __future__ import annotations

import argparse
import faulthandler
import os

import torch

from sao_megatron.config.schema import ModelConfig, OptimizerConfig, ParallelConfig
from sao_megatron.models.actor import token_logprobs
from sao_megatron.models.builder import build_model_chunks
from sao_megatron.parallel.cpu_support import apply_cpu_shims
from sao_megatron.training.run.checkpoint import load_checkpoint, save_checkpoint
from sao_megatron.parallel.bootstrap import destroy, init_distributed
from sao_megatron.training.step.optim import setup_optimizer, optimizer_step

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    kv_channels=8, num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
                    vocab_size=64, max_position_embeddings=32)


def main(workdir: str, skip: list[str]) -> None:
    apply_cpu_shims(skip=skip)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    parallel = (ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True)
                if world == 4 else ParallelConfig())
    ctx = init_distributed(parallel, seed=5)
    g = torch.Generator().manual_seed(0)
    mbs = [{"tokens": torch.randint(0, MODEL.vocab_size, (2, 8), generator=g)} for _ in range(2)]

    def loss_fn(logits, mb):
        lp, _ = token_logprobs(logits, mb["tokens"], tp_group=ctx.tp_group, vocab_size=MODEL.vocab_size)
        loss = -lp.sum() / 1000
        return loss, {"loss": loss.detach()}

    chunks = build_model_chunks(MODEL, ctx)
    ddp, opt, sched = setup_optimizer(chunks, OptimizerConfig(lr=1e-3), ctx, total_steps=2)
    optimizer_step(ddp, opt, sched, mbs, loss_fn, ctx=ctx)
    save_checkpoint(f"{workdir}/ckpt", ddp, opt)
    fresh = build_model_chunks(MODEL, ctx)
    fresh_ddp, fresh_opt, _ = setup_optimizer(fresh, OptimizerConfig(lr=1e-3), ctx, total_steps=2)
    load_checkpoint(f"{workdir}/ckpt", fresh_ddp, fresh_opt)
    optimizer_step(fresh_ddp, fresh_opt, sched, mbs, loss_fn, ctx=ctx)
    destroy()
    print("OK", flush=True)


if __name__ == "__main__":  # dist checkpoint saving starts a multiprocessing manager
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--skip", action="append", default=[])
    parser.add_argument("--hang-timeout", type=float, default=240.0)
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.hang_timeout, exit=True)
    main(args.workdir, args.skip)
