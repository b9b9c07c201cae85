"""The run's audit of stale drops (issue 16): every dropped sample with its length and versions in
RUN_DIR/audit_dropped.jsonl, rolled back with the trained-sample audit on resume, and summarised by
response-length quartile for ``sao-megatron report``."""

from __future__ import annotations

import json

import pytest

from sao_megatron.scheduler.sample import Sample
from sao_megatron.scheduler.stats import stale_drop_by_length
from sao_megatron.training.verbs.report import stale_drop_summary
from sao_megatron.training.run.run_state import RunState

pytestmark = pytest.mark.unit


def sample(index: int, num_actions: int, versions: tuple[int, int]) -> Sample:
    mask = [1] * num_actions + [0, 0]
    vers = [versions[0]] * (num_actions - 1) + [versions[1]] + [-1, -1]
    return Sample(prompt_ids=[1], response_ids=list(range(len(mask))), action_mask=mask,
                  rollout_logprobs=[0.0] * len(mask), versions=vers, index=index)


def read(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x]


def test_dropped_samples_are_audited_with_length_and_versions_and_rolled_back(tmp_path):
    state = RunState(tmp_path, keep_last=1, rank0=True)
    trained = [sample(i, n, (3, 4)) for i, n in enumerate([2, 3, 4, 5, 6, 7])]
    state.audit(trained, step=4, version=4, phase="rl")
    state.audit_dropped([(sample(10, 30, (1, 3)), 4), (sample(11, 40, (2, 2)), 4)], step=4)
    state.audit_dropped([(sample(12, 9, (3, 5)), 6)], step=6)
    rows = read(tmp_path / "audit_dropped.jsonl")
    assert [(r["index"], r["num_action_tokens"], r["response_len"], r["oldest_version"], r["newest_version"],
             r["dropped_at_version"], r["step"]) for r in rows] == [
        (10, 30, 32, 1, 3, 4, 4), (11, 40, 42, 2, 2, 4, 4), (12, 9, 11, 3, 5, 6, 6)]
    assert [r["num_action_tokens"] for r in read(tmp_path / "audit.jsonl")] == [2, 3, 4, 5, 6, 7]
    summary = stale_drop_summary(tmp_path)
    assert summary == stale_drop_by_length([2, 3, 4, 5, 6, 7], [30, 40, 9])
    assert summary["rollout/stale_drop_frac_q4"] == 1.0 and summary["rollout/stale_drop_frac_q1"] == 0.0
    state.truncate_audit(5)  # resume from a checkpoint at step 5: the drop at step 6 never happened
    assert [r["index"] for r in read(tmp_path / "audit_dropped.jsonl")] == [10, 11]


def test_no_drop_summary_without_drops(tmp_path):
    state = RunState(tmp_path, keep_last=1, rank0=True)
    state.audit([sample(0, 3, (0, 0))], step=0, version=0, phase="rl")
    state.audit_dropped([], step=0)
    assert stale_drop_summary(tmp_path) is None and not (tmp_path / "audit_dropped.jsonl").exists()
