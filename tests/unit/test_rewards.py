"""Reward workers: failures are contained (reward 0 + reason), the event loop is never blocked."""

from __future__ import annotations

import asyncio
import math
import os
import time

import pytest

from sao_megatron.envs import ArithmeticTask, RewardPool

pytestmark = pytest.mark.unit


def test_failing_rewards_give_zero_with_a_reason_and_the_pool_recovers():
    task = ArithmeticTask(num_prompts=4)
    p = task.prompts()[0]
    demo = task.demonstration(p)
    good_fn, good_args = task.reward_call(p, demo, [1] * len(demo), "")

    async def run():
        pool = RewardPool(2, timeout_s=0.5)
        await pool.start()
        calls = [pool.score(int, "x"), pool.score(time.sleep, 5), pool.score(os._exit, 3),
                 pool.score(float, "nan"), pool.score(lambda: 1.0), pool.score(str, "1.0")]
        bad = await asyncio.gather(*calls)
        good = await asyncio.gather(*(pool.score(good_fn, *good_args) for _ in range(4)))
        errors = pool.num_errors
        pool.close()
        return bad, good, errors
    bad, good, errors = asyncio.run(run())
    assert all(o.reward == 0.0 for o in bad) and errors == len(bad)
    reasons = [o.error for o in bad]
    assert reasons[0].startswith("exception: ValueError: invalid literal")
    assert reasons[1] == "timeout after 0.5 s" and bad[1].elapsed_s < 4.0  # not the 5 s sleep
    assert reasons[2] == "reward worker died"
    assert "finite number" in reasons[3] and "cannot send" in reasons[4] and "finite number" in reasons[5]
    assert [o.reward for o in good] == [1.0] * 4 and all(o.error is None for o in good)  # replaced workers work


def test_rewards_run_off_the_event_loop_in_parallel_workers():
    async def run():
        pool = RewardPool(2, timeout_s=5)
        await pool.start()
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1
        t = asyncio.create_task(ticker())
        t0 = time.monotonic()
        outs = await asyncio.gather(pool.score(time.sleep, 1.0), pool.score(time.sleep, 1.0))
        elapsed = time.monotonic() - t0
        t.cancel()
        pool.close()
        return outs, elapsed, ticks
    outs, elapsed, ticks = asyncio.run(run())
    assert all(o.error == "exception: reward must be a finite number or (number, dict), got None" for o in outs)
    assert elapsed < 1.9  # two workers: both sleeps overlapped (serial: >= 2 s)
    assert ticks >= 10  # the loop kept running meanwhile (blocked: ~0)


def test_cancelled_reward_call_retires_its_worker():
    async def run():
        pool = RewardPool(1, timeout_s=5)
        await pool.start()
        task = asyncio.create_task(pool.score(time.sleep, 0.3))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        out = await pool.score(math.sqrt, 16.0)  # a fresh worker answers correctly (no stale reply)
        pool.close()
        return out
    out = asyncio.run(run())
    assert out.reward == 4.0 and out.error is None
