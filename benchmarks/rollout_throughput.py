"""Rollout throughput through our scheduler and client vs a bare /generate loop, on real SGLang.

One real SGLang 0.5.23 server on CPU (``scripts/setup.sh --sglang``; pass its python with
``--sglang-python`` or ``$SAO_SGLANG_PYTHON``) serving a tiny random Qwen3-MoE whose vocabulary is
the arithmetic task's. Two ways (arms) to keep ``--concurrency`` requests in flight for ``--seconds``
each, against the same server:

- bare: ``--concurrency`` coroutines each posting ``/generate`` in a loop with httpx (no parsing
  beyond the completion count), the prompts and sampling the scheduler uses;
- ours: ``AsyncScheduler`` (mode single, no weight updates, admission never the limit) through
  ``RolloutClient``, consuming batches of ``--batch-size``; tokens of consumed samples count.

Each of ``--rounds`` rounds runs both arms back to back, in alternating order (bare first in even
rounds, ours first in odd ones), so load that drifts over minutes hits both arms of a round alike.
Prints each round's tokens/s and ratio ours / bare with the machine's 1-minute load average, then
the median of the per-round ratios (target >= 0.9) and their spread (min, max): on a loaded machine
the median of side-by-side ratios is the number to read, wall tokens/s are not.

    python benchmarks/rollout_throughput.py --sglang-python ~/.cache/sao-megatron/sglang-venv-*/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from sao_megatron.config.schema import SchedulerConfig
from sao_megatron.envs import ArithmeticTask
from sao_megatron.rollout.client import RolloutClient
from sao_megatron.rollout.launch import SGLangEngines
from sao_megatron.rollout.types import SamplingParams
from sao_megatron.scheduler import AsyncScheduler


def build_model(out: Path, vocab: int, eos: int) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=eos, bos_token_id=1)
    Qwen3MoeForCausalLM(cfg).save_pretrained(out)
    return out


async def bare(url: str, task, sampling: SamplingParams, concurrency: int, seconds: float) -> float:
    prompts = task.prompts()
    sp = sampling.to_sglang()
    tokens, nxt, deadline = 0, 0, time.monotonic() + seconds
    start = time.monotonic()

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal tokens, nxt
        while time.monotonic() < deadline:
            prompt = prompts[nxt % len(prompts)]
            nxt += 1
            body = {"input_ids": task.make_env().reset(prompt), "sampling_params": sp,
                    "return_logprob": True, "logprob_start_len": -1}
            r = await http.post(url + "/generate", json=body)
            tokens += r.json()["meta_info"]["completion_tokens"]
    async with httpx.AsyncClient(trust_env=False, timeout=600,
                                 limits=httpx.Limits(max_connections=None)) as http:
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
    return tokens / (time.monotonic() - start)


async def ours(url: str, task, sampling: SamplingParams, concurrency: int, batch: int, seconds: float) -> float:
    cfg = SchedulerConfig(mode="single", batch_size=batch, concurrency=concurrency, max_staleness=1 << 20)
    async with RolloutClient([url]) as client:
        sched = AsyncScheduler(client, task, cfg, sampling, mode="single", reward_workers=1)
        await sched.start()
        start, tokens = time.monotonic(), 0
        try:
            while time.monotonic() - start < seconds:
                tokens += sum(len(s.response_ids) for s in await sched.next_batch(batch))
            return tokens / (time.monotonic() - start)
        finally:
            await sched.stop()


def run_round(url: str, task, sampling: SamplingParams, a, bare_first: bool) -> dict[str, float]:
    """Both arms once, back to back (``bare_first`` picks the order); tokens/s of each."""
    arms = {"bare": lambda: bare(url, task, sampling, a.concurrency, a.seconds),
            "ours": lambda: ours(url, task, sampling, a.concurrency, a.batch_size, a.seconds)}
    order = ["bare", "ours"] if bare_first else ["ours", "bare"]
    load = os.getloadavg()[0]
    out = {name: asyncio.run(arms[name]()) for name in order}
    return out | {"ratio": out["ours"] / out["bare"], "load": (load + os.getloadavg()[0]) / 2}


def report(rounds: list[dict[str, float]], a) -> None:
    print(f"concurrency {a.concurrency}, max_new_tokens {a.max_new_tokens}, {len(rounds)} rounds x 2 arms x "
          f"{a.seconds:.0f} s, arms alternating first")
    print("round   bare tok/s   ours tok/s   ours/bare   load(1 min)")
    for k, r in enumerate(rounds):
        print(f"{k:5d}   {r['bare']:10.1f}   {r['ours']:10.1f}   {r['ratio']:9.3f}   {r['load']:11.1f}")
    ratios = [r["ratio"] for r in rounds]
    print(f"ratio ours / bare: median {statistics.median(ratios):.3f} over {len(ratios)} rounds, spread "
          f"{min(ratios):.3f} .. {max(ratios):.3f}  (target >= 0.9)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sglang-python", default=os.environ.get("SAO_SGLANG_PYTHON"))
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args()
    if not a.sglang_python:
        raise SystemExit("--sglang-python (or $SAO_SGLANG_PYTHON): the python `bash scripts/setup.sh --sglang` prints")
    task = ArithmeticTask(num_prompts=512)
    tok = task.tokenizer
    sampling = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=1.0, stop_token_ids=task.stop_token_ids)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", tok.vocab_size, tok.eos_id)
        with SGLangEngines(model, 1, python=a.sglang_python, device="cpu", max_total_tokens=16384,
                           extra_args=["--skip-tokenizer-init"], log_dir=Path(tmp) / "logs") as engines:
            url = engines.urls[0]
            asyncio.run(bare(url, task, sampling, a.concurrency, 5.0))  # warm-up (first-call compiles)
            rounds = [run_round(url, task, sampling, a, bare_first=k % 2 == 0) for k in range(a.rounds)]
    report(rounds, a)


if __name__ == "__main__":
    main()
