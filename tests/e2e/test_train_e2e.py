"""End to end: the real trainer (Megatron actor + critic on gloo), real embedded engines over HTTP.

Small step counts keep this within the CI budget; the reward-learning run itself is the main
job (`make run`) and is measured in docs/benchmarks.md, not asserted here.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import psutil
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "component"))  # the one megatron_launch (its server) of the session
from megatron_launch import launch  # noqa: E402

CONFIG = REPO / "configs" / "experiments" / "tiny_cpu.yaml"
SMALL = ["run.num_steps=4", "run.sft_steps=2", "run.sft_batch_size=16", "scheduler.batch_size=8",
         "scheduler.concurrency=16", "critic.pretrain_steps=1", "checkpoint.save_interval=2",
         "logging.log_interval=1", "data.num_prompts=400"]

pytestmark = pytest.mark.e2e


def train_args(run_dir, *overrides, resume="auto") -> list[str]:
    """``sao_megatron.cli train ...`` arguments of the small run (after ``python -m``)."""
    sets = [a for o in [*SMALL, *overrides] for a in ("--set", o)]
    return ["sao_megatron.cli", "train", "--config", str(CONFIG), "--run-dir", str(run_dir), "--resume", resume, *sets]


def train_cmd(run_dir, *overrides, resume="auto"):
    """The whole command line, for tests that signal the trainer's process themselves."""
    return [sys.executable, "-m", *train_args(run_dir, *overrides, resume=resume)]


def run_train(run_dir, *overrides, timeout=600):
    """One training run to completion, forked from the session's preloaded server (megatron_launch: the
    trainer's process skips ~6 CPU-s of torch + Megatron imports, as torchrun's ranks do there)."""
    proc = launch(train_args(run_dir, *overrides), module=True, cwd=REPO, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def read_jsonl(path):
    return [json.loads(x) for x in pathlib.Path(path).read_text().splitlines() if x.strip()]


def metrics_by_step(run_dir):
    by = {}
    for rec in read_jsonl(run_dir / "metrics.jsonl"):
        by[rec["step"]] = rec
    return [by[k] for k in sorted(by)]


def audit_unique(run_dir):
    recs = read_jsonl(run_dir / "audit.jsonl")
    keys = [(r["epoch"], r["index"]) for r in recs]
    assert len(keys) == len(set(keys)), "a prompt was trained twice"
    return recs


def assert_learning_metrics_consistent(m):
    """Every loss/statistic finite and each loss equal to what its inputs give.

    The 4-step budget run never earns a reward (measured: reward 0 on every sample), so returns, values,
    advantages and both losses must be exactly 0: a loss or gradient from nowhere fails here. Learning
    itself (reward rising) is the main job's, measured in the README.
    """
    import math

    stats = {k: v for k, v in m.items() if k.split("/")[0] in ("actor", "critic", "advantages", "returns", "reward")
             and k != "critic/explained_var"}
    assert all(isinstance(v, float) and math.isfinite(v) for v in stats.values()), stats
    assert 0.0 <= m["reward/min"] <= m["reward/mean"] <= m["reward/max"] <= 1.0
    if m["reward/max"] == 0.0:
        assert m["returns/max"] == m["returns/min"] == 0.0 and m["critic/values_max"] == m["critic/values_min"] == 0.0
        assert m["advantages/max"] == m["advantages/min"] == 0.0
        assert m["actor/pg_loss"] == m["actor/loss"] == m["actor/grad_norm"] == m["critic/loss"] == 0.0
    assert m["actor/entropy"] > 0.0 and m["actor/ess"] <= 1.0 + 1e-9


def test_sao_steps_version_bookkeeping_staleness_and_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    run_train(run_dir)
    metrics = metrics_by_step(run_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    assert [m["version"] for m in metrics] == [1, 2, 3, 4]  # one weight update per step
    for m in metrics:
        assert_learning_metrics_consistent(m)
        assert m["rollout/staleness_max"] <= 1 and m["actor/update_applied"] == 1.0
    # Every step's row carries its own push, the last one's too (overlapped, the default: the row waits
    # for the push to finish; before, a row carried the previous step's push and the last was lost).
    assert all(m["rollout/weight_sync_bytes"] > 0 and m["timing/weight_push_s"] > 0 for m in metrics)
    # On-policy at step 0 (samples of version 0, trainer at version 0): the trainer's log-probs are the
    # reference for the engine's; measured |ratio - 1| <= 5e-7 (fp32 reduction order), 1e-4 allowed.
    assert abs(metrics[0]["actor/ratio_min"] - 1) < 1e-4 and abs(metrics[0]["actor/ratio_max"] - 1) < 1e-4
    assert abs(metrics[0]["actor/kl_k1"]) < 1e-4
    recs = audit_unique(run_dir)
    rl = [r for r in recs if r["phase"] == "rl"]
    assert len(rl) == 4 * 8 and len([r for r in recs if r["phase"] == "value_pretrain"]) == 8
    for r in rl:  # staleness audit against max_staleness = 1, with the trainer's version at consumption
        assert r["oldest_version"] is not None and r["version"] - r["oldest_version"] <= 1
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert ckpts == ["step_00000002", "step_00000004"]
    state = json.loads((run_dir / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())
    assert state["version"] == 4 and state["scheduler"]["version"] == 4
    assert (run_dir / "config.yaml").is_file()


# A second whole run (41-86 s) in CI's slow stage: the default suite has GRPO's update without a critic
# (test_trainer_layouts) and the scheduler's group mode against real engines (test_scheduler_engine).
@pytest.mark.slow
def test_grpo_baseline_runs(tmp_path):
    run_dir = tmp_path / "grpo"
    run_train(run_dir, "algorithm.name=grpo", "algorithm.group_size=4", "run.num_steps=2")  # mode: auto -> group
    metrics = metrics_by_step(run_dir)
    assert len(metrics) == 2 and all(m["actor/update_applied"] == 1.0 for m in metrics)
    assert "critic/loss" not in metrics[0]
    groups = {}
    for r in read_jsonl(run_dir / "audit.jsonl"):
        groups.setdefault((r["step"], r["group_id"]), set()).add(r["index"])
    assert all(len(idx) == 1 for idx in groups.values())  # a group = G rollouts of one prompt
    assert sorted({len([1 for r in read_jsonl(run_dir / "audit.jsonl") if r["group_id"] == g[1]])
                   for g in groups}) == [4]


@pytest.mark.slow  # over 60 s on 2 cores (66-107 s measured): runs in CI's slow stage
def test_kill_and_resume_trains_every_prompt_once(tmp_path):
    run_dir = tmp_path / "killed"
    overrides = ["run.num_steps=6", "checkpoint.save_interval=2"]
    proc = subprocess.Popen(train_cmd(run_dir, *overrides), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 400
    try:
        # Kill hard once the first checkpoint exists and a later step has been logged.
        while time.time() < deadline:
            done = (run_dir / "checkpoints" / "step_00000002").is_dir()
            steps = len(read_jsonl(run_dir / "metrics.jsonl")) if (run_dir / "metrics.jsonl").exists() else 0
            if done and steps >= 3:
                break
            assert proc.poll() is None, "training ended before it could be killed"
            time.sleep(0.5)
        else:
            pytest.fail("no checkpoint within the deadline")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.time() + 30  # engines run in their own sessions but must die with the trainer
    while time.time() < deadline and engines_of(run_dir):
        time.sleep(0.5)
    assert not engines_of(run_dir), "engines outlived the killed trainer"
    run_train(run_dir, *overrides)
    recs = audit_unique(run_dir)
    rl = [r for r in recs if r["phase"] == "rl"]
    assert sorted({r["step"] for r in rl}) == list(range(6)) and len(rl) == 6 * 8
    assert [m["version"] for m in metrics_by_step(run_dir)] == list(range(1, 7))


def engines_of(run_dir) -> list[str]:
    # psutil reads whole command lines; `ps -eo args` cuts them at $COLUMNS, which hid the run dir.
    found = []
    for p in psutil.process_iter(["cmdline"]):
        line = " ".join(p.info["cmdline"] or [])
        if "serve-local" in line and str(run_dir) in line:
            found.append(line)
    return found


def test_unreachable_engine_fails_before_training(tmp_path):
    run_dir = tmp_path / "noengine"
    proc = launch(train_args(run_dir, "rollout.engine=sglang", "rollout.engine_urls=[http://127.0.0.1:9]",
                             "rollout.startup_timeout_s=3", "run.sft_steps=0"),
                  module=True, cwd=REPO, timeout=300, check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("sao-megatron train: error:") and "127.0.0.1:9" in last
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # no step was trained
    assert not list((run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").exists() else True
