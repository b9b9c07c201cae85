"""The real trainer on a corrupted checkpoint (issue 18, part 3), with async checkpoint saving.

A 4-step run saves step 2 and step 4 asynchronously; one data file of step 4 is truncated (what a
node dying mid-copy or a full disk leaves). ``--resume auto`` must fall back to step 2 with a
warning naming the file and finish with metrics.jsonl holding each step once; an explicit
``--resume`` of the corrupt checkpoint must fail with one line naming the file.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from test_train_e2e import REPO, audit_unique, read_jsonl, run_train, train_cmd

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_truncated_latest_checkpoint_falls_back_and_metrics_stay_unique(tmp_path):
    run_dir = tmp_path / "run"
    run_train(run_dir, "checkpoint.async_save=true", "logging.tensorboard=true")
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == ["step_00000002",
                                                                                     "step_00000004"]
    for step in ("step_00000002", "step_00000004"):  # published by the async path with a manifest
        manifest = json.loads((ckpts / step / "manifest.json").read_text())
        assert {"actor/metadata.json", "critic/metadata.json", "trainer_state.json"} <= set(manifest["files"])
    bad = max((ckpts / "step_00000004" / "actor").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with bad.open("r+b") as f:
        f.truncate(bad.stat().st_size // 2)

    explicit = subprocess.run(train_cmd(run_dir, "run.num_steps=6", resume=str(ckpts / "step_00000004")),
                              cwd=REPO, capture_output=True, text=True, timeout=600)
    assert explicit.returncode != 0
    last = explicit.stderr.strip().splitlines()[-1]
    assert last.startswith("sao-megatron train: error:") and str(bad) in last and "truncated" in last

    proc = run_train(run_dir, "run.num_steps=6", "checkpoint.async_save=true", "logging.tensorboard=true")
    out = proc.stdout + proc.stderr
    assert "skipping step_00000004" in out and bad.name in out
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(6))  # steps 2, 3 trained again: their first rows are gone
    rl = [r for r in audit_unique(run_dir) if r["phase"] == "rl"]
    assert sorted({r["step"] for r in rl}) == list(range(6))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == list(range(6))
