"""Step time added by a checkpoint save: sync vs async, and the cost of the manifest's checksums.

One process (world size 1, gloo; CPU shims unless --device cuda), a Megatron MoE model with its
distributed Adam optimizer, trained on random tokens. For each mode the script runs training
steps, saves once, keeps training until the checkpoint is published, and reports

- blocking: the seconds the training loop spends inside ``save`` (+ publishing, for sync);
- added: the extra wall time of the steps from the save until the checkpoint is published,
  over the same number of steps without a save (median step time of a no-save run);

side by side with the plain sync save (megatron-core dist-checkpointing, no manifest) as the
baseline, and megatron-core's own ``verify_integrity`` (SHA-256 by reading every file back after
the save) as the alternative to checksums computed in the write path.

    python benchmarks/checkpoint_save.py                       # 224 MB of model + optimizer state
    python benchmarks/checkpoint_save.py --hidden 512 --experts 16

Measured on the shared 2-core CPU box (9 workers; noisy), defaults, 2026-12-01:

    checkpoint: 224.5 MB (model + optimizer), step without a save: 1618 ms, median of 3 saves
    mode                  blocking s   added s  vs plain   until published s
    plain                     17.275    17.275      1.00               0.000
    sync+manifest             15.713    15.713      0.91               0.000
    verify_integrity          17.109    17.109      0.99               0.000
    async+manifest             8.132    19.191      1.11              10.296

The CRCs in the write path cost nothing measurable next to the save itself (within the noise).
Async halves the time the loop is blocked, but on two shared cores the forked writer competes
with CPU training for the same cores, so the total added step time does not drop; the win needs
the GPU case (training on the GPU, the writer on otherwise idle host cores), not measured here.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import statistics
import tempfile
import time


def build(args):
    from sao_megatron.config.schema import ModelConfig, OptimizerConfig, ParallelConfig
    from sao_megatron.parallel import cpu_support
    from sao_megatron.models.builder import build_model_chunks
    from sao_megatron.parallel.bootstrap import init_distributed
    from sao_megatron.training.step.optim import setup_optimizer

    if args.device == "cpu":
        cpu_support.apply_cpu_shims()
    ctx = init_distributed(ParallelConfig(), seed=0)
    cfg = ModelConfig(family="qwen3_moe", num_layers=args.layers, hidden_size=args.hidden,
                      ffn_hidden_size=2 * args.hidden, num_attention_heads=8, num_query_groups=4,
                      kv_channels=args.hidden // 8, num_moe_experts=args.experts, moe_ffn_hidden_size=args.hidden,
                      moe_router_topk=2, vocab_size=1024, max_position_embeddings=256)
    chunks = build_model_chunks(cfg, ctx)
    ddp, opt, sched = setup_optimizer(chunks, OptimizerConfig(lr=1e-4), ctx, total_steps=10_000)
    return ctx, cfg, chunks, ddp, opt, sched


def make_step(ctx, cfg, ddp, opt, sched, device):
    import torch

    from sao_megatron.training.step.optim import optimizer_step

    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)

    def step() -> float:
        t0 = time.perf_counter()
        optimizer_step(ddp, opt, sched, [{"tokens": tokens}],
                   _lse_loss, ctx=ctx)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    return step


def save_once(mode, path, chunks, opt):
    """Start one save in ``mode``; returns (seconds blocked, CheckpointSaves, published flag)."""
    from megatron.core import dist_checkpointing

    from sao_megatron.training.run import checkpoint as ck

    published: list[bool] = []
    t0 = time.perf_counter()
    if mode in ("plain", "verify_integrity"):  # megatron-core alone: the baselines
        state = ck.sharded_model_state(chunks)
        state["optimizer"] = opt.sharded_state_dict(state, is_loading=False, metadata=ck.OPTIMIZER_SHARDING)
        (path / "actor").mkdir(parents=True)
        dist_checkpointing.save(state, str(path / "actor"), verify_integrity=mode == "verify_integrity")
        saves = ck.CheckpointSaves(async_save=False)
        published.append(True)
    else:
        saves = ck.CheckpointSaves(async_save=mode == "async+manifest")
        ck.save_checkpoint(path / "actor", chunks, opt, saves=saves)
        saves.then(lambda: ck.publish_checkpoint(path, lambda: published.append(True)))
    return time.perf_counter() - t0, saves, published


def run_mode(mode, root, chunks, opt, step, base_step_s, repeats):
    blocked, added, background = [], [], []
    for r in range(repeats):
        path = root / f"{mode}_{r}"
        blocking, saves, published = save_once(mode, path, chunks, opt)
        t0, n = time.perf_counter(), 0
        while not published:
            step()
            saves.poll()
            n += 1
        spent = time.perf_counter() - t0
        blocked.append(blocking)
        added.append(blocking + spent - n * base_step_s)
        background.append(spent)
        shutil.rmtree(path)
    return {"blocking": statistics.median(blocked), "added": statistics.median(added),
            "until_published": statistics.median(background)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    ctx, cfg, chunks, ddp, opt, sched = build(args)
    step = make_step(ctx, cfg, ddp, opt, sched, args.device)
    for _ in range(3):
        step()  # warm-up; Adam state exists
    base = statistics.median(step() for _ in range(8))
    root = pathlib.Path(tempfile.mkdtemp(prefix="ckpt_bench_", dir=args.dir))
    try:
        modes = ["plain", "sync+manifest", "verify_integrity", "async+manifest"]
        res = {m: run_mode(m, root, chunks, opt, step, base, args.repeats) for m in modes}
        save_once("sync+manifest", root / "size", chunks, opt)
        size = sum(p.stat().st_size for p in (root / "size").rglob("*") if p.is_file())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"checkpoint: {size / 1e6:.1f} MB (model + optimizer), step without a save: {base * 1e3:.0f} ms, "
          f"median of {args.repeats} saves")
    print(f"{'mode':<20}{'blocking s':>12}{'added s':>10}{'vs plain':>10}{'until published s':>20}")
    for m, r in res.items():
        print(f"{m:<20}{r['blocking']:>12.3f}{r['added']:>10.3f}{r['added'] / res['plain']['added']:>10.2f}"
              f"{r['until_published']:>20.3f}")


def _lse_loss(logits, mb):
    """A loss that touches every parameter (so Adam state exists); the one step reports it."""
    loss = logits.float().logsumexp(-1).mean()
    return loss, {"loss": loss.detach()}


if __name__ == "__main__":  # dist checkpoint saving starts a multiprocessing manager
    main()
