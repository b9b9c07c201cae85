"""Processes the trainer starts (engines, the router, reward workers) see none of torchrun's variables."""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys

import pytest

from sao_megatron.envs import RewardPool
from sao_megatron.parallel.launcher_env import child_env, is_launcher_variable
from sao_megatron.rollout.launch import LocalEngines

pytestmark = pytest.mark.unit

# What torchrun's agent gives rank 3 of a 4-rank job (torch distributed/elastic/agent/server/local_elastic_agent.py).
TORCHRUN_RANK_ENV = {
    "RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "3", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_ERROR_FILE": "/tmp/torchelastic_x/error.json",
}
KEPT = {"SAO_TEST_USER_VARIABLE": "kept", "OMP_NUM_THREADS": "1"}
"""The user's own variables and torchrun's tuning defaults: children keep them."""


@pytest.fixture
def torchrun_rank(monkeypatch):
    for name, value in {**TORCHRUN_RANK_ENV, **KEPT}.items():
        monkeypatch.setenv(name, value)


class _EnvDumpingEngines(LocalEngines):
    """The engines' spawn path with a command that writes its environment instead of serving."""

    def _command(self, port_file):
        return [sys.executable, "-c", "import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], 'w'))",
                f"{port_file}.env"]


def test_an_engine_started_by_a_torchrun_rank_sees_none_of_its_launcher_variables(torchrun_rank, tmp_path):
    engines = _EnvDumpingEngines(tmp_path, 1, log_dir=tmp_path)
    proc, port_file, log = engines._spawn("engine0")
    assert proc.wait(60) == 0, log.read_text()
    env = json.loads(pathlib.Path(f"{port_file}.env").read_text())
    assert not set(env) & set(TORCHRUN_RANK_ENV), sorted(set(env) & set(TORCHRUN_RANK_ENV))
    assert {k: env.get(k) for k in KEPT} == KEPT


def test_a_reward_worker_of_a_torchrun_rank_sees_none_of_its_launcher_variables(torchrun_rank):
    # ``spawn``: the child starts from the environment as it is now (the default fork server would
    # keep the one of its first start in this pytest process). The reward: how many it sees.
    seen = f"float(sum(k in __import__('os').environ for k in {sorted(TORCHRUN_RANK_ENV)!r}))"
    kept = f"float(all(__import__('os').environ.get(k) == v for k, v in {KEPT!r}.items()))"

    async def run():
        pool = RewardPool(1, timeout_s=120.0, start_method="spawn")
        try:
            return await pool.score(eval, seen), await pool.score(eval, kept)
        finally:
            pool.close()
    outcome_seen, outcome_kept = asyncio.run(run())
    assert outcome_seen.error is None and outcome_kept.error is None, (outcome_seen, outcome_kept)
    assert (outcome_seen.reward, outcome_kept.reward) == (0.0, 1.0)


def test_child_env_drops_exactly_the_launcher_variables():
    base = {**TORCHRUN_RANK_ENV, **KEPT, "TORCHELASTIC_SOMETHING_NEW": "1", "RANKING": "x"}
    assert child_env(base) == {**KEPT, "RANKING": "x"}  # a name is matched whole, TORCHELASTIC_ as a prefix
    assert all(is_launcher_variable(k) for k in TORCHRUN_RANK_ENV)
