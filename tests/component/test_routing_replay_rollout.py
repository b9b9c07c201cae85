"""Routed experts survive partial rollouts: real embedded engine over HTTP, real weight updates.

Weight updates (three different random checkpoints) land while episodes generate, under
``partial_rollout=retract`` (the default) and ``abort``. Each generated token's route row (the row of
the position that predicted it) must equal the router top-k of a fresh HF forward of the checkpoint
whose weights sampled the token: no row of an earlier token may carry a re-prefill's routes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from rollout_fixtures import LAYERS, TOPK, build_tiny_moe, hf_routed_experts

from sao_megatron.config.schema import SchedulerConfig
from sao_megatron.envs import ArithmeticTask, CharTokenizer
from sao_megatron.rollout.client import RolloutClient
from sao_megatron.rollout.launch import LocalEngines
from sao_megatron.rollout.types import SamplingParams
from sao_megatron.scheduler import AsyncScheduler

pytestmark = pytest.mark.component
TOK = CharTokenizer()
SAMPLING = SamplingParams(max_new_tokens=24, temperature=1.0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("r3-moe")
    return [str(build_tiny_moe(root / f"v{seed}", seed=seed, eos_token_id=TOK.eos_id, bos_token_id=TOK.bos_id))
            for seed in range(3)]


@pytest.fixture(scope="module")
def engine(ckpts, tmp_path_factory):
    with LocalEngines(ckpts[0], 1, log_dir=tmp_path_factory.mktemp("r3-engine-logs"),
                      extra_args=["--max-running-requests", "8", "--enable-return-routed-experts"]) as eng:
        yield eng


async def run(engine, ckpts, partial: str, steps: int = 3):
    client = RolloutClient(engine.urls, timeout_s=120, routed_experts_layout=(LAYERS, TOPK))
    await client.update_weights_from_disk(ckpts[0], weight_version=0)
    cfg = SchedulerConfig(mode="single", batch_size=4, concurrency=8, max_staleness=2, partial_rollout=partial)
    sched = AsyncScheduler(client, ArithmeticTask(num_prompts=100, seed=5), cfg, SAMPLING, reward_workers=1,
                           return_routed_experts=True, retry_backoff_s=0.05)
    samples = []
    try:
        await sched.start()
        for _ in range(steps):
            samples += await sched.next_batch()
            await until_a_request_has_output(client)  # the update lands mid-generation
            v = sched.version + 1

            async def push(v=v):
                await client.begin_weight_update()
                await client.update_weights_from_disk(ckpts[v % 3], weight_version=v)
                await client.end_weight_update()
            await sched.on_weights_updated(v, push)
    finally:
        await sched.stop()
        await client.aclose()
    return samples


async def until_a_request_has_output(client, timeout_s: float = 5.0) -> None:
    """Until the engine holds a request with output tokens: a fixed sleep after the first open request
    let the update land, under load, when every open request was still queued or just finished, and
    no episode crossed it."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        states = [s for info in await client.server_info() for s in info.get("internal_states", [])]
        if any(n > 0 for s in states for n in s.get("num_output_tokens", {}).values()):
            return
        await asyncio.sleep(0.005)


def wrong_rows(sample, ckpts) -> list[tuple[int, int]]:
    """(position, version) of every generated token whose predicting row is not its version's route."""
    tokens = sample.prompt_ids + sample.response_ids
    ref = {v: hf_routed_experts(Path(ckpts[v % 3]), tokens[:-1]).numpy() for v in set(sample.action_versions)}
    got = np.sort(sample.routed_experts, -1)
    p = len(sample.prompt_ids)
    return [(p + t, v) for t, v in enumerate(sample.versions)
            if v >= 0 and not np.array_equal(got[p + t - 1], np.sort(ref[v][p + t - 1], -1))]


@pytest.mark.parametrize("partial", ["retract", pytest.param("abort", marks=pytest.mark.slow)])
def test_routes_of_each_token_come_from_the_weights_that_sampled_it(engine, ckpts, partial):
    samples = asyncio.run(run(engine, ckpts, partial))
    mixed = [s for s in samples if len(set(s.action_versions)) > 1]
    assert mixed, "no episode crossed a weight update"
    for s in samples:
        assert s.routed_experts.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, LAYERS, TOPK)
        assert not wrong_rows(s, ckpts), f"rows re-routed by a later prefill: {wrong_rows(s, ckpts)}"
