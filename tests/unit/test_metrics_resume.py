"""Metric sinks after a kill and resume: no step twice in metrics.jsonl, TensorBoard or wandb (issue 18.3).

Each test plays the trainer's sequence: a first process logs steps, dies; a second process opens
the sinks again, rolls them back to the checkpoint's step (``resume_at``) and logs from there.
"""

from __future__ import annotations

import json

import pytest

from sao_megatron.config import LoggingConfig
from sao_megatron.training.run.metrics_log import MetricsLogger

pytestmark = pytest.mark.unit


def segment(run_dir, cfg, steps, *, resume_at=None, offset=0.0):
    """One trainer process: open the sinks, roll back to ``resume_at``, log ``steps``, exit."""
    logger = MetricsLogger(run_dir, cfg, run_name="r")
    if resume_at is not None:
        logger.resume_at(resume_at)
    for s in steps:
        logger.log(s, {"reward/mean": offset + s})
    logger.close()


def jsonl(run_dir):
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_keeps_one_row_per_step_the_one_trained_last(tmp_path):
    cfg = LoggingConfig(log_interval=0)
    segment(tmp_path, cfg, range(6))               # killed after step 5; the checkpoint holds 3 steps
    segment(tmp_path, cfg, range(3, 8), resume_at=3, offset=100)
    rows = jsonl(tmp_path)
    assert [r["step"] for r in rows] == list(range(8))
    assert [r["reward/mean"] for r in rows] == [0, 1, 2, 103, 104, 105, 106, 107]


def test_restart_from_scratch_empties_the_log(tmp_path):
    cfg = LoggingConfig(log_interval=0)
    segment(tmp_path, cfg, range(2))  # killed before the first checkpoint
    segment(tmp_path, cfg, range(2), resume_at=0, offset=10)
    assert [r["reward/mean"] for r in jsonl(tmp_path)] == [10, 11]


def scalars(tb_dir, tag="reward/mean"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return [(e.step, round(e.value, 3)) for e in acc.Scalars(tag)]


@pytest.mark.component
def test_tensorboard_purges_the_rolled_back_steps(tmp_path):
    cfg = LoggingConfig(tensorboard=True, log_interval=0)
    segment(tmp_path, cfg, range(6))
    segment(tmp_path, cfg, range(3, 8), resume_at=3, offset=100)
    assert scalars(tmp_path / "tensorboard") == [(0, 0), (1, 1), (2, 2), (3, 103), (4, 104), (5, 105),
                                                 (6, 106), (7, 107)]
    # Without the rollback TensorBoard shows both copies of steps 3..5 (the test above can fail).
    other = tmp_path / "no_rollback"
    other.mkdir()
    segment(other, cfg, range(6))
    segment(other, cfg, range(3, 8), offset=100)
    assert len(scalars(other / "tensorboard")) == 11


class FakeWandbRun:
    """Stands in for ``wandb.init()``'s run: records what would be sent."""

    def __init__(self, sent):
        self.sent = sent

    def log(self, data, step):
        self.sent.append(step)

    def finish(self):
        pass


def test_wandb_never_receives_a_step_twice_across_two_resumes(tmp_path, monkeypatch):
    import wandb

    sent: list[int] = []
    monkeypatch.setattr(wandb, "init", lambda **kw: FakeWandbRun(sent))
    cfg = LoggingConfig(wandb=True, log_interval=0)
    segment(tmp_path, cfg, range(8))                    # killed after step 7; checkpoint at 4
    segment(tmp_path, cfg, range(4, 7), resume_at=4)    # killed after step 6 (before the checkpoint at 8)
    segment(tmp_path, cfg, range(4, 12), resume_at=4)
    assert sent == list(range(12))                      # wandb cannot rewind: nothing is sent twice
    assert [r["step"] for r in jsonl(tmp_path)] == list(range(12))
