"""`sao-megatron train` with rollout.routing_replay=true on the tiny CPU run: engines return routes,
the actor replays them, every step logs the routes the trainer would have changed."""

from __future__ import annotations

import pytest
from test_train_e2e import audit_unique, metrics_by_step, run_train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_training_with_routing_replay_logs_route_mismatch(tmp_path):
    run_dir = tmp_path / "run"
    run_train(run_dir, "rollout.routing_replay=true")
    steps = metrics_by_step(run_dir)
    assert len(steps) == 4 and all(0.0 <= m["rollout/route_mismatch_frac"] <= 1.0 for m in steps)
    assert steps[0]["rollout/route_mismatch_frac"] < 0.01  # version-0 samples, trainer at version 0
    assert all(abs(m["actor/ratio_mean"] - 1.0) < 0.2 for m in steps)
    audit_unique(run_dir)
