"""Stale drops by response length: the scheduler's consume orders side by side (issue 16).

Under an asynchronous staleness limit η a sample whose oldest token is older than ``v − η`` when
the trainer would take it is dropped. Long responses finish late, so they are the ones dropped:
with ``fifo`` consumption the longest quartile is starved. This runs the real ``AsyncScheduler``
and ``RolloutClient`` over HTTP against the simulated continuous-batching engines of
benchmarks/scheduler.py (log-normal response lengths, simulated trainer step and weight push)
once per ``scheduler.consume_order``, in the same process with the same engine seeds, and prints
per order: trained samples/s and its ratio to ``fifo``, the stale-drop rate overall and per
response-length quartile (quartiles of every finished sample of that run), the dropped samples'
mean length over the mean (1 = length-blind), the trained top-quartile share, and staleness.

    python benchmarks/scheduler_stale.py                 # eta=1, about 2 minutes on 2 busy cores
    python benchmarks/scheduler_stale.py --eta 2 --steps 20
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time

from scheduler import SimEngine, add_sim_args  # benchmarks/scheduler.py (this directory is on sys.path when run as a script)

from sao_megatron.config.schema import SchedulerConfig
from sao_megatron.envs import ArithmeticTask
from sao_megatron.rollout.client import RolloutClient
from sao_megatron.rollout.types import SamplingParams
from sao_megatron.scheduler import AsyncScheduler
from sao_megatron.scheduler.stats import stale_drop_by_length

ORDERS = ("fifo", "oldest_first", "wait_oldest")


async def run_order(args, order: str) -> dict:
    engines = [SimEngine(slots=args.slots, token_s=args.token_ms / 1000, median=args.median_len,
                         sigma=args.sigma, seed=i) for i in range(args.engines)]
    for e in engines:
        await e.start()
    client = RolloutClient([e.url for e in engines], timeout_s=600)
    cfg = SchedulerConfig(mode="single", batch_size=args.batch_size, concurrency=args.concurrency,
                          max_staleness=args.eta, partial_rollout="retract", consume_order=order)
    sched = AsyncScheduler(client, ArithmeticTask(num_prompts=100_000), cfg,
                           SamplingParams(max_new_tokens=args.max_new_tokens), reward_workers=2)
    await sched.start()
    kept, dropped, stale = [], [], []
    t0 = time.monotonic()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            t0 = time.monotonic()
            sched.take_dropped()
        batch = await sched.next_batch()
        if step >= args.warmup:
            kept += [s.num_action_tokens for s in batch]
            dropped += [s.num_action_tokens for s, _ in sched.take_dropped()]
            stale += [s.staleness(sched.version) for s in batch]
        await asyncio.sleep(args.train_step_s)

        async def push(v=sched.version + 1):
            await client.update_weights_from_disk(str(args.sync_s), weight_version=v)
        await sched.on_weights_updated(sched.version + 1, push)
    wall = time.monotonic() - t0
    await sched.stop()
    await client.aclose()
    for e in engines:
        await e.close()
    lengths = sorted(kept + dropped)
    top = lengths[(3 * len(lengths)) // 4] if lengths else 0
    return {"samples_per_s": len(kept) / wall, "wall_s": wall, "trained": len(kept), "dropped": len(dropped),
            "staleness_mean": sum(stale) / max(len(stale), 1),
            "top_share": sum(n > top for n in kept) / max(len(kept), 1),
            **stale_drop_by_length(kept, dropped)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--eta", type=int, default=1)
    add_sim_args(p, steps=14)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--orders", default=",".join(ORDERS))
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(f"eta={args.eta}, engines={args.engines}x{args.slots} slots, {args.token_ms} ms/token, lengths "
          f"lognormal(median {args.median_len}, sigma {args.sigma}) cap {args.max_new_tokens}, B={args.batch_size}, "
          f"concurrency={args.concurrency}, train step {args.train_step_s} s, {args.steps} steps")
    results = {o: asyncio.run(run_order(args, o)) for o in args.orders.split(",")}
    base = next(iter(results.values()))["samples_per_s"]
    print(f"{'order':13} {'samples/s':>9} {'ratio':>6} {'trained':>7} {'dropped':>7} {'drop':>6} "
          f"{'q1':>6} {'q2':>6} {'q3':>6} {'q4':>6} {'len ratio':>9} {'top share':>9} {'stale':>5}")
    for order, r in results.items():
        qs = " ".join(f"{r.get(f'rollout/stale_drop_frac_q{k}', 0.0):6.1%}" for k in range(1, 5))
        print(f"{order:13} {r['samples_per_s']:9.1f} {r['samples_per_s'] / base:5.2f}x {r['trained']:7d} "
              f"{r['dropped']:7d} {r.get('rollout/stale_drop_frac', 0.0):6.1%} {qs} "
              f"{r.get('rollout/stale_drop_len_ratio', 0.0):9.2f} {r['top_share']:9.1%} {r['staleness_mean']:5.2f}")


if __name__ == "__main__":
    main()
