"""A command posted to the embedded engine (pause, weight load) waits at most one prefill, not a
whole admission round: a trainer's pause used to wait for up to ``max_running`` prefills."""

from __future__ import annotations

import pytest
from rollout_fixtures import tiny_dirs  # noqa: F401 - fixture
from test_rollout_engine_core import make_request

from sao_megatron.rollout.engine.core import EngineCore
from sao_megatron.rollout.engine.model import ModelRunner
from sao_megatron.rollout.types import SamplingParams

pytestmark = pytest.mark.component


def test_command_posted_during_admission_runs_after_one_prefill(tiny_dirs):  # noqa: F811
    runner = ModelRunner(tiny_dirs["base"])
    core = EngineCore(runner, max_running=8)
    replies: dict = {}
    for i in range(4):
        core.add(make_request(f"r{i}", [5 + i, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True), replies))
    seen: list[int] = []  # prefills done when the pause ran
    posted: list[bool] = []
    prefill = runner.prefill

    def prefill_then_pause(*args, **kwargs):  # the trainer's pause arrives while the first prompt prefills
        if not posted:
            posted.append(True)
            core.post(lambda: (seen.append(core.stats["prefills"]), core.pause("retract")))
        return prefill(*args, **kwargs)
    runner.prefill = prefill_then_pause
    for _ in range(3):
        core.step()
    assert seen == [1]  # old code: 4 (every waiting request prefilled before the pause ran)
    assert core.paused and not core.running and len(core.waiting) == 4  # the pause itself still retracts all
