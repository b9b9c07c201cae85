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
    # Replayed routes: at step 0 (same weights) the trainer reproduces the engine's log-probs; measured
    # |ratio - 1| <= 5e-7 (fp32 reduction order), 1e-4 allowed. Later steps mix samples of the previous
    # version (staleness 1): measured |ratio_mean - 1| <= 0.0043, 0.02 allowed (~5x).
    assert abs(steps[0]["actor/ratio_min"] - 1.0) < 1e-4 and abs(steps[0]["actor/ratio_max"] - 1.0) < 1e-4
    assert all(abs(m["actor/ratio_mean"] - 1.0) < 0.02 for m in steps)
    audit_unique(run_dir)
