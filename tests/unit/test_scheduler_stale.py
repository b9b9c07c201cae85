"""Stale drops by response length (issue 16): long responses finish late, so under an asynchronous
staleness limit they are the samples dropped. The drop rate per length quartile is measured, every
drop is kept for the audit, and the default consume order does not starve long responses."""

from __future__ import annotations

import asyncio
import json

import pytest

from sao_megatron.config.schema import SchedulerConfig
from sao_megatron.envs import ArithmeticTask
from sao_megatron.rollout.types import SamplingParams
from sao_megatron.scheduler import AsyncScheduler
from sao_megatron.scheduler.stats import stale_drop_by_length
from test_scheduler_logic import TOK, FakeClient, train_loop

pytestmark = pytest.mark.unit
LONG, SHORT = 40, 2


def lengths_script(input_ids):
    """One prompt in four gets a long response (LONG tokens), the others a short one."""
    n = LONG if sum(input_ids) % 4 == 0 else SHORT
    return [20 + (i % 20) for i in range(n)] + [TOK.eos_id]


def run(order: str | None, steps: int = 8):
    async def go():
        client = FakeClient(token_time=0.002, script=lengths_script)
        kw = {} if order is None else {"consume_order": order}
        cfg = SchedulerConfig(mode="single", batch_size=4, concurrency=12, max_staleness=1, **kw)
        sched = AsyncScheduler(client, ArithmeticTask(num_prompts=400), cfg, SamplingParams(max_new_tokens=64),
                               reward_workers=1, retry_backoff_s=0.01)
        await sched.start()
        consumed = await train_loop(sched, client, steps, update_sleep=0.005, between=0.02)
        dropped = sched.take_dropped()
        metrics = sched.metrics()
        await sched.stop()
        return consumed, dropped, metrics
    return asyncio.run(go())


def long_counts(consumed, dropped):
    trained = [s for _, batch in consumed for s in batch]
    return (sum(s.num_action_tokens > SHORT + 1 for s in trained),
            sum(s.num_action_tokens > SHORT + 1 for s, _ in dropped))


@pytest.mark.slow
def test_fifo_consumption_starves_long_responses():
    """The problem, measured: in finish order the long responses are the stale ones (and every drop
    is handed out for the audit with the version it was dropped at)."""
    consumed, dropped, metrics = run("fifo")
    long_trained, long_dropped = long_counts(consumed, dropped)
    assert long_dropped > 0 and long_dropped == len(dropped)  # only long responses go stale
    assert metrics["rollout/stale_drop_frac_q1"] == 0.0 and metrics["rollout/stale_drop_len_ratio"] > 1.5
    for s, version in dropped:
        assert min(s.action_versions) < version - 1  # stale when dropped
    json.dumps([s.to_dict() for s, _ in dropped])


def test_default_consume_order_does_not_starve_long_responses():
    consumed, dropped, metrics = run(None)
    long_trained, long_dropped = long_counts(consumed, dropped)
    trained = [s for _, batch in consumed for s in batch]
    assert long_dropped == 0 and not dropped
    assert long_trained >= len(trained) // 8  # about one in four prompts is long
    for v, batch in consumed:  # the staleness limit still holds for every trained token
        assert all(min(s.action_versions) >= v - 1 for s in batch)
    assert metrics.get("rollout/stale_drop_frac_q4", 0.0) == 0.0


def reference_drop_by_length(kept, dropped, bins=4):
    """Slow: rank all finished samples by length; bin k holds ranks up to ceil(k n / bins), ties go low."""
    allv = sorted(kept + dropped)
    edges = [allv[-(-k * len(allv) // bins) - 1] for k in range(1, bins)]
    out = {}
    for k in range(bins):
        lo = edges[k - 1] if k else float("-inf")
        hi = edges[k] if k < bins - 1 else float("inf")
        members_kept = [n for n in kept if lo < n <= hi]
        members_dropped = [n for n in dropped if lo < n <= hi]
        total = len(members_kept) + len(members_dropped)
        out[k + 1] = len(members_dropped) / total if total else 0.0
    return out


@pytest.mark.parametrize("kept,dropped", [
    ([1, 2, 3, 4, 5, 6], [7, 8]),
    ([5, 5, 5, 5], [5, 9]),
    ([10, 1, 7, 3, 3, 8, 2], [30, 1, 12]),
    ([4], []),
])
def test_stale_drop_by_length_matches_reference(kept, dropped):
    got = stale_drop_by_length(kept, dropped)
    expected = reference_drop_by_length(kept, dropped)
    assert [got[f"rollout/stale_drop_frac_q{k}"] for k in range(1, 5)] == pytest.approx([expected[k] for k in range(1, 5)])
    assert got["rollout/stale_drop_frac"] == pytest.approx(len(dropped) / (len(kept) + len(dropped)))
    mean = sum(kept + dropped) / len(kept + dropped)
    if dropped:
        assert got["rollout/stale_drop_len_ratio"] == pytest.approx(sum(dropped) / len(dropped) / mean)
    else:
        assert "rollout/stale_drop_len_ratio" not in got
