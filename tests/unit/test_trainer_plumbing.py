"""Micro-batch planning, checkpoint directory management, metrics and report plumbing."""

from __future__ import annotations

import json
import random

import pytest
import torch

from sao_megatron.config import LoggingConfig
from sao_megatron.rollout.async_bridge import AsyncBridge
from sao_megatron.training.run.metrics_log import MetricsLogger, read_metrics
from sao_megatron.training.step.microbatch import plan_microbatches, round_up, slice_padded
from sao_megatron.training.run.run_state import CheckpointManager, capture_rng, restore_rng

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("seed", range(20))
def test_microbatch_plan_covers_every_sample_once_within_budget(seed):
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(1, 30), rng.randint(100, 400)]) for _ in range(rng.randint(1, 60))]
    budget, mult = rng.choice([256, 512, 1024]), rng.choice([1, 2, 4])
    plan = plan_microbatches(lengths, max_tokens=budget, pad_multiple=mult)
    flat = sorted(i for g in plan.indices for i in g)
    assert flat == list(range(len(lengths)))
    for g, s in zip(plan.indices, plan.seq_lengths):
        assert s % mult == 0 and s >= max(lengths[i] for i in g)
        assert len(g) == 1 or len(g) * s <= budget


def test_microbatch_plan_wastes_less_padding_than_fixed_batches():
    rng = random.Random(0)
    lengths = [int(rng.paretovariate(1.2) * 20) for _ in range(128)]
    plan = plan_microbatches(lengths, max_tokens=4096)
    # Fixed micro-batches of 8 in arrival order, each padded to its longest row.
    fixed = sum(8 * max(lengths[i:i + 8]) for i in range(0, 128, 8))
    assert plan.num_padded_tokens < fixed
    assert plan.num_padded_tokens <= 1.5 * sum(lengths)


def test_microbatch_count_multiple_splits_without_empty_groups():
    plan = plan_microbatches([5] * 9, max_tokens=1000, num_microbatches_multiple=4)
    assert len(plan.indices) % 4 == 0 and all(plan.indices)


def test_slice_padded_pads_and_cuts():
    t = {"a": torch.arange(12).view(3, 4), "b": torch.ones(3, 4, 2)}
    out = slice_padded(t, [2, 0], 6)
    assert out["a"].tolist() == [[8, 9, 10, 11, 0, 0], [0, 1, 2, 3, 0, 0]]
    assert out["b"].shape == (2, 6, 2) and out["b"][:, 4:].abs().sum() == 0
    assert slice_padded(t, [1], 2)["a"].tolist() == [[4, 5]]
    assert round_up(5, 4) == 8 and round_up(8, 4) == 8


def test_checkpoint_manager_commit_latest_and_prune(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        part = mgr.begin(step)
        (part / "x").write_text(str(step))
        assert mgr.latest() in (None, mgr.final_dir(step - 1))  # a partial is never "latest"
        mgr.commit(step)
    assert mgr.complete_steps() == [2, 3]
    assert (mgr.latest() / "x").read_text() == "3"
    mgr.begin(4)  # crash before commit: resume must still pick step 3
    assert mgr.latest() == mgr.final_dir(3)
    (tmp_path / "latest").unlink()
    assert mgr.latest() == mgr.final_dir(3)
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


def test_rng_capture_restore_reproduces_draws():
    state = capture_rng()
    a = (random.random(), torch.rand(3).tolist())
    restore_rng(state)
    assert (random.random(), torch.rand(3).tolist()) == a


def test_metrics_logger_jsonl_and_resume_dedup(tmp_path):
    logger = MetricsLogger(tmp_path, LoggingConfig(log_interval=1), run_name="t")
    logger.log(0, {"reward/mean": torch.tensor(0.5), "actor/ratio_max": float("inf")})
    logger.log(1, {"reward/mean": 0.25})
    logger.log(1, {"reward/mean": 0.75})  # re-logged after a resume
    logger.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["reward/mean"] == 0.5 and lines[0]["actor/ratio_max"] == "inf"
    assert [r["reward/mean"] for r in read_metrics(tmp_path)] == [0.5, 0.75]
    with pytest.raises(ValueError, match="metrics.jsonl"):
        read_metrics(tmp_path / "nope")


def test_report_writes_pngs(tmp_path):
    from sao_megatron.training.verbs.report import write_report

    logger = MetricsLogger(tmp_path, LoggingConfig(log_interval=0), run_name="t")
    for step in range(12):
        logger.log(step, {"reward/mean": step / 12, "rollout/staleness_max": step % 3,
                          "rollout/staleness_hist": {"0": 5, "1": step}, "rollout/phase": step // 6,
                          "actor/dis_masked_low_frac": 0.01, "critic/explained_var": 0.1})
    logger.close()
    paths = write_report(tmp_path)
    names = {p.name for p in paths}
    assert {"reward.png", "staleness_hist.png", "phase_adaptation.png"} <= names
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_async_bridge_runs_coroutines_and_times_out():
    import asyncio

    bridge = AsyncBridge()
    try:
        async def add(a, b):
            await asyncio.sleep(0.01)
            return a + b

        assert bridge.run(add(1, 2)) == 3
        with pytest.raises(TimeoutError):
            bridge.run(asyncio.sleep(5), timeout=0.05)
    finally:
        bridge.close()


@pytest.mark.component
def test_tensorboard_and_wandb_offline_sinks(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggingConfig(tensorboard=True, wandb=True, wandb_mode="offline", log_interval=0)
    logger = MetricsLogger(tmp_path, cfg, run_name="sinks", config_dict={"a": 1})
    for step in range(3):
        logger.log(step, {"reward/mean": 0.1 * step, "train/token_lag_hist": {"0": 3}})
    logger.close()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [round(e.value, 3) for e in acc.Scalars("reward/mean")] == [0.0, 0.1, 0.2]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and any(p.suffix == ".wandb" for p in runs[0].iterdir())


def test_token_ids_outside_the_vocabulary_stop_the_update():
    from sao_megatron.errors import SaoError
    from sao_megatron.training.step.batch import check_token_ids

    check_token_ids(torch.tensor([[0, 5, 99]]), vocab_size=100)
    check_token_ids(torch.zeros(0, 3, dtype=torch.long), vocab_size=100)
    for bad in (100, -1):
        with pytest.raises(SaoError, match=f"token id {bad}, outside model.vocab_size=100"):
            check_token_ids(torch.tensor([[0, bad, 3]]), vocab_size=100)


def _probe_run_dir_repeatedly(path: str, rounds: int) -> int:
    from sao_megatron.training.verbs.cli import _check_run_dir

    failures = 0
    for _ in range(rounds):
        try:
            _check_run_dir(path)
        except ValueError:
            failures += 1
    return failures


def test_run_dir_check_survives_every_local_rank_probing_at_once(tmp_path):
    """All local ranks of a node check the run dir at the same moment (CI's 3-node Slurm job failed on it
    when one rank unlinked the probe file another had just written)."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(4) as pool:
        failures = pool.starmap(_probe_run_dir_repeatedly, [(str(tmp_path / "run"), 300)] * 4)
    assert sum(failures) == 0
    assert list((tmp_path / "run").iterdir()) == []  # no probe left behind
