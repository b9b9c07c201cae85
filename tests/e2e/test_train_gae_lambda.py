"""λ < 1 end to end (issue 16): the real trainer with γ, λ below 1 on a multi-turn tool task, with
skip-observation GAE and with plain token GAE (whose critic then also trains on the tool
observations between turns). At γ = λ = 1 the two estimators coincide, so λ < 1 is the setting in
which the skip-vs-plain ablation means anything; this checks that it trains, not what it learns."""

from __future__ import annotations

import math

import pytest
from test_train_e2e import metrics_by_step, read_jsonl, run_train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MULTI_TURN = ["data.task=calculator", "data.max_turns=3", "data.max_total_tokens=64", "data.max_prompt_tokens=16",
              "data.options={min_operand: 1, max_operand: 9, num_operands: 2, ops: '+', sandbox: unsafe}",
              "rollout.max_new_tokens=12", "run.num_steps=2", "checkpoint.save_interval=0",
              "algorithm.gae.gamma=0.99", "algorithm.gae.lam=0.9"]


@pytest.mark.parametrize("skip", [True, False], ids=["skip_observation", "token"])
def test_lambda_below_one_trains_on_a_multi_turn_task(tmp_path, skip):
    run_dir = tmp_path / str(skip)
    run_train(run_dir, *MULTI_TURN, f"algorithm.gae.skip_observations={str(skip).lower()}")
    metrics = metrics_by_step(run_dir)
    assert [m["version"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["actor/update_applied"] == 1.0
        values = {k: m.get(k) for k in ("actor/loss", "critic/loss", "returns/std", "critic/value_abs_error")}
        assert all(isinstance(v, float) and math.isfinite(v) for v in values.values()), values
    config = (run_dir / "config.yaml").read_text()
    assert "lam: 0.9" in config and f"skip_observations: {str(skip).lower()}" in config
    assert read_jsonl(run_dir / "audit.jsonl")
