"""Checkpoints with manifests, sync and async (world size 1, in a subprocess: the CPU shims stay out of pytest).

    python checkpoint_integrity.py RESULTS.json WORKDIR

Writes WORKDIR/sync (a sync save + manifest) and WORKDIR/async (an async save whose model was
changed in place while the writer ran), then loads the async one into a fresh model. The test
corrupts the files afterwards and checks them against CRCs it computes itself.
"""

from __future__ import annotations

import json
import os
import sys

import torch

# Megatron and the package are imported inside main(): saving spawns a multiprocessing manager,
# which re-imports this module, and it should not pay for those imports again.


TINY = dict(family="qwen3_moe", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
            num_query_groups=2, kv_channels=8, num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
            vocab_size=100, max_position_embeddings=64)


def params(chunks) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in chunks[0].named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def main(out_path: str, workdir: str) -> None:
    from sao_megatron.config.schema import ModelConfig, OptimizerConfig, ParallelConfig
    from sao_megatron.parallel import cpu_support
    from sao_megatron.models.builder import build_model_chunks
    from sao_megatron.training.run.checkpoint import (CheckpointSaves, load_checkpoint, publish_checkpoint,
                                                  save_checkpoint)
    from sao_megatron.parallel.bootstrap import destroy, init_distributed
    from sao_megatron.training.step.optim import setup_optimizer, optimizer_step

    tiny = ModelConfig(**TINY)
    cpu_support.apply_cpu_shims()
    ctx = init_distributed(ParallelConfig(), seed=3)
    chunks = build_model_chunks(tiny, ctx)
    ddp, opt, sched = setup_optimizer(chunks, OptimizerConfig(lr=1e-2), ctx, total_steps=4)
    tokens = torch.randint(0, tiny.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    optimizer_step(ddp, opt, sched, [{"tokens": tokens}], _lse_loss,
               ctx=ctx)  # Adam state exists
    out: dict = {}

    sync = CheckpointSaves(async_save=False)
    save_checkpoint(f"{workdir}/sync/actor", chunks, opt, saves=sync)
    sync.then(lambda: publish_checkpoint(f"{workdir}/sync", lambda: None))

    saves = CheckpointSaves(async_save=True)
    at_save = params(chunks)
    save_checkpoint(f"{workdir}/async/actor", chunks, opt, saves=saves)
    save_checkpoint(f"{workdir}/async/critic", chunks, opt, saves=saves)  # two parts, one writer (as the trainer)
    saves.then(lambda: publish_checkpoint(f"{workdir}/async", lambda: out.setdefault("published_pending", saves.pending)))
    out["pending_after_schedule"] = saves.pending
    out["manifest_before_wait"] = os.path.exists(f"{workdir}/async/manifest.json")
    with torch.no_grad():  # the trainer keeps training while the writer runs
        for p in chunks[0].parameters():
            p.add_(1.0)
    changed = params(chunks)
    saves.wait()
    out["pending_after_wait"] = saves.pending

    for part in ("actor", "critic"):
        fresh = build_model_chunks(tiny, ctx)
        _, fresh_opt, _ = setup_optimizer(fresh, OptimizerConfig(lr=1e-2), ctx, total_steps=4)
        with torch.no_grad():
            for p in fresh[0].parameters():
                p.zero_()
        load_checkpoint(f"{workdir}/async/{part}", fresh, fresh_opt)
        loaded = params(fresh)
        out[f"async_{part}_vs_at_save"] = max_diff(loaded, at_save)
        out[f"async_{part}_vs_changed"] = max_diff(loaded, changed)
    out["num_params"] = len(loaded)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    destroy()


def _lse_loss(logits, mb):
    """A loss that touches every parameter (so Adam state exists); the one step reports it."""
    loss = logits.float().logsumexp(-1).mean()
    return loss, {"loss": loss.detach()}


if __name__ == "__main__":  # dist checkpoint saving starts a multiprocessing manager
    main(sys.argv[1], sys.argv[2])
