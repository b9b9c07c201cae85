"""Scheduling throughput: async single-rollout vs group vs sync, with long-tailed response lengths.

What runs: the real ``AsyncScheduler`` and ``RolloutClient`` over HTTP against simulated engines:
a minimal in-process HTTP server per engine speaking SGLang's ``/generate`` (plus pause/continue,
weight update, health) with continuous batching: up to ``--slots`` requests decode together, one
token each per ``--token-ms`` step (a GPU engine below saturation). Response lengths are
log-normal (median ``--median-len``, shape ``--sigma``, capped at ``--max-new-tokens``): a few
responses are many times longer than the median, as in RL on reasoning tasks. The trainer is
simulated: after each batch it "trains" for ``--train-step-s`` and pushes weights (``--sync-s``).
This measures scheduling, not model speed.

Reported per configuration: trained samples/s, ratio to sync, engine idle fraction (share of wall
time an engine had no request running, measured inside the engine), slot occupancy, staleness.

    python benchmarks/scheduler.py            # default settings (about 3 minutes on 2 busy cores)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field

from sao_megatron.config.schema import SchedulerConfig
from sao_megatron.envs import ArithmeticTask
from sao_megatron.rollout.client import RolloutClient
from sao_megatron.rollout.types import SamplingParams
from sao_megatron.scheduler import AsyncScheduler


@dataclass
class _Req:
    rid: str
    prompt_len: int
    target: int
    max_new: int
    done: asyncio.Future
    out: list[int] = field(default_factory=list)
    vers: list[int] = field(default_factory=list)


class SimEngine:
    """Continuous-batching token generator behind a tiny HTTP/1.1 server (keep-alive, JSON bodies)."""

    def __init__(self, *, slots: int, token_s: float, median: float, sigma: float, seed: int):
        self.slots, self.token_s = slots, token_s
        self.median, self.sigma = median, sigma
        self.rng = random.Random(seed)
        self.version, self.paused = 0, False
        self.running: list[_Req] = []
        self.waiting: deque[_Req] = deque()
        self.wake = asyncio.Event()
        self.busy_s = self.slot_s = 0.0
        self._reset_at = 0.0
        self.url = ""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        self._loop = asyncio.create_task(self._decode_loop())

    async def close(self) -> None:
        self._loop.cancel()
        self._server.close()

    def reset_accounting(self) -> None:
        self.busy_s = self.slot_s = 0.0
        self._reset_at = time.monotonic()  # a step straddling the reset counts only from here

    async def _decode_loop(self) -> None:
        while True:
            while self.waiting and len(self.running) < self.slots and not self.paused:
                self.running.append(self.waiting.popleft())
            if self.paused or not self.running:
                self.wake.clear()
                await self.wake.wait()
                continue
            t0 = time.monotonic()
            await asyncio.sleep(self.token_s)
            dt = time.monotonic() - max(t0, self._reset_at)
            self.busy_s += dt
            self.slot_s += dt * len(self.running)
            if self.paused:  # retract: tokens of this step are not emitted
                continue
            for r in list(self.running):
                r.out.append(self.rng.randrange(7, 100))
                r.vers.append(self.version)
                if len(r.out) >= min(r.target, r.max_new):
                    self.running.remove(r)
                    r.done.set_result("stop" if r.target < r.max_new else "length")

    async def generate(self, body: dict) -> dict:
        max_new = body["sampling_params"]["max_new_tokens"]
        target = max(1, round(self.median * math.exp(self.sigma * self.rng.gauss(0, 1))))
        req = _Req(body["rid"], len(body["input_ids"]), target, max_new, asyncio.get_running_loop().create_future())
        self.waiting.append(req)
        self.wake.set()
        finish = await req.done
        if finish == "stop":
            req.out[-1] = 2  # eos
        spans, start = [], 0
        for i in range(1, len(req.vers) + 1):
            if i == len(req.vers) or req.vers[i] != req.vers[start]:
                spans.append({"version": str(req.vers[start]), "start": start, "end": i})
                start = i
        reason = {"type": finish} if finish != "length" else {"type": "length", "length": len(req.out)}
        return {"text": "", "output_ids": req.out, "meta_info": {
            "id": req.rid, "finish_reason": reason, "prompt_tokens": req.prompt_len,
            "completion_tokens": len(req.out), "output_token_logprobs": [[-1.0, t, None] for t in req.out],
            "weight_version": str(self.version), "weight_versions": spans}}

    async def control(self, path: str, body: dict | None) -> dict:
        if path == "/pause_generation":
            self.paused = True
            if (body or {}).get("mode") == "abort":
                for r in self.running + list(self.waiting):
                    r.done.set_result("abort")
                self.running, self.waiting = [], deque()
        elif path == "/continue_generation":
            self.paused = False
            self.wake.set()
        elif path == "/update_weights_from_disk":
            await asyncio.sleep(float(body.get("model_path", "0")))  # the push takes --sync-s
            self.version = int(body["weight_version"])
        return {"success": True, "weight_version": str(self.version)}

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                _, path, _ = line.decode().split(" ", 2)
                headers = {}
                while (h := await reader.readline()) not in (b"\r\n", b""):
                    k, v = h.decode().split(":", 1)
                    headers[k.strip().lower()] = v.strip()
                raw = await reader.readexactly(int(headers.get("content-length", 0)))
                body = json.loads(raw) if raw else None
                reply = await (self.generate(body) if path == "/generate" else self.control(path, body))
                data = json.dumps(reply).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(data)).encode() + b"\r\n\r\n" + data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


async def run_config(args, *, mode: str, eta: int, group: int) -> dict:
    engines = [SimEngine(slots=args.slots, token_s=args.token_ms / 1000, median=args.median_len,
                         sigma=args.sigma, seed=i) for i in range(args.engines)]
    for e in engines:
        await e.start()
    client = RolloutClient([e.url for e in engines], timeout_s=600)
    cfg = SchedulerConfig(mode=mode, batch_size=args.batch_size, concurrency=args.concurrency,
                          max_staleness=eta, partial_rollout="retract")
    sched = AsyncScheduler(client, ArithmeticTask(num_prompts=100_000), cfg,
                           SamplingParams(max_new_tokens=args.max_new_tokens), group_size=group, reward_workers=2)
    await sched.start()
    trained, t0 = 0, time.monotonic()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            t0 = time.monotonic()
            for e in engines:
                e.reset_accounting()
            sched.metrics()
        batch = await sched.next_batch()
        trained += len(batch) if step >= args.warmup else 0
        await asyncio.sleep(args.train_step_s)  # the trainer's step; generation goes on meanwhile (async modes)

        async def push(v=sched.version + 1):
            await client.update_weights_from_disk(str(args.sync_s), weight_version=v)
        await sched.on_weights_updated(sched.version + 1, push)
    wall = time.monotonic() - t0
    busy, slot = sum(e.busy_s for e in engines), sum(e.slot_s for e in engines)  # snapshot at the window's end
    m = sched.metrics()
    await sched.stop()
    await client.aclose()
    for e in engines:
        await e.close()
    return {"samples_per_s": trained / wall, "idle": max(0.0, 1 - busy / (wall * len(engines))),
            "occupancy": slot / (wall * args.slots * len(engines)),
            "staleness_mean": m.get("rollout/staleness_mean", 0.0), "staleness_max": m.get("rollout/staleness_max", 0.0),
            "dropped_stale": m["rollout/dropped_stale"], "wall_s": wall}


CONFIGS = [("sync", "sync", 0, 1), ("single eta=1", "single", 1, 1), ("single eta=2", "single", 2, 1),
           ("single eta=4", "single", 4, 1), ("group G=8 eta=1", "group", 1, 8)]


def add_sim_args(p: argparse.ArgumentParser, *, steps: int) -> None:
    """The simulated engines' and trainer's flags (shared with scheduler_stale.py)."""
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--slots", type=int, default=32, help="requests decoded together per engine")
    p.add_argument("--token-ms", type=float, default=5.0, help="decode step time")
    p.add_argument("--median-len", type=float, default=80)
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal shape of response lengths")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--train-step-s", type=float, default=0.25, help="simulated trainer step")
    p.add_argument("--sync-s", type=float, default=0.02, help="simulated weight push")
    p.add_argument("--steps", type=int, default=steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sim_args(p, steps=12)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(f"engines={args.engines}x{args.slots} slots, {args.token_ms} ms/token, lengths lognormal(median "
          f"{args.median_len}, sigma {args.sigma}) cap {args.max_new_tokens}, B={args.batch_size}, "
          f"concurrency={args.concurrency}, train step {args.train_step_s} s, {args.steps} steps")
    results = {}
    for name, mode, eta, group in CONFIGS:
        results[name] = asyncio.run(run_config(args, mode=mode, eta=eta, group=group))
    base = results["sync"]["samples_per_s"]
    print(f"{'config':18} {'samples/s':>10} {'vs sync':>8} {'idle':>7} {'occupancy':>9} {'stale mean/max':>15} "
          f"{'dropped':>8} {'wall s':>7}")
    for name, r in results.items():
        print(f"{name:18} {r['samples_per_s']:10.1f} {r['samples_per_s'] / base:7.2f}x {r['idle']:7.1%} "
              f"{r['occupancy']:9.1%} {r['staleness_mean']:7.2f}/{r['staleness_max']:<7.0f} "
              f"{r['dropped_stale']:8.0f} {r['wall_s']:7.1f}")


if __name__ == "__main__":
    main()
