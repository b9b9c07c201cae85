"""Reward workers: failures are contained (reward 0 + reason), the event loop is never blocked."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
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
        calls = [pool.score(int, "x"), pool.score(time.sleep, 60), pool.score(os._exit, 3),
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
    assert reasons[1] == "timeout after 0.5 s" and bad[1].elapsed_s < 15.0  # not the 60 s sleep
    assert reasons[2] == "reward worker died"
    assert "finite number" in reasons[3] and "cannot send" in reasons[4] and "finite number" in reasons[5]
    assert [o.reward for o in good] == [1.0] * 4 and all(o.error is None for o in good)  # replaced workers work


# A reward call that announces itself (creates argv[1]) and then waits for argv[2]; exit 0 once it
# appears, 1 after 60 s. Events, not wall time: robust on a loaded machine.
_RENDEZVOUS = ("import os, sys, time\nopen(sys.argv[1], 'w').close()\nend = time.monotonic() + 60\n"
               "while not os.path.exists(sys.argv[2]):\n    if time.monotonic() > end: sys.exit(1)\n"
               "    time.sleep(0.01)\n")


def test_rewards_run_off_the_event_loop_in_parallel_workers(tmp_path):
    """Both calls wait until the event loop has seen both running, then released: serial workers or
    a blocked loop would leave them waiting (reward 1, the exit code)."""
    ready, go = [str(tmp_path / f"ready{i}") for i in range(2)], str(tmp_path / "go")

    async def release_when_both_run():
        while not all(os.path.exists(r) for r in ready):
            await asyncio.sleep(0.01)
        open(go, "w").close()

    async def run():
        pool = RewardPool(2, timeout_s=120)
        await pool.start()
        releaser = asyncio.create_task(release_when_both_run())
        outs = await asyncio.gather(*(pool.score(subprocess.call, [sys.executable, "-S", "-c", _RENDEZVOUS, r, go])
                                      for r in ready))
        releaser.cancel()
        pool.close()
        return outs
    outs = asyncio.run(run())
    assert [(o.reward, o.error) for o in outs] == [(0.0, None), (0.0, None)]  # exit code 0: released


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
