"""Run a study plan: one ``sao-megatron train`` subprocess per run, ``jobs`` at a time.

Each run owns ``OUT/<variant>/seed<k>/``; a run that finished has ``study_done.json`` there and is
skipped, a run that was interrupted resumes from its latest checkpoint (``--resume auto``), so the
same command continues a study. The estimate of the remaining time uses the wall time per trained
sample of the runs already finished, else the study file's ``seconds_per_sample`` and ``startup_s``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable

from sao_megatron.study.spec import Plan, PlannedRun

log = logging.getLogger(__name__)
DONE_FILE = "study_done.json"


def is_done(run: PlannedRun) -> bool:
    return (run.run_dir / DONE_FILE).is_file()


def trained_steps(run: PlannedRun) -> int:
    """Steps in the run's metrics.jsonl (a trainer stopped by a signal exits 0 before its last step)."""
    path = run.run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    return int(json.loads(lines[-1])["step"]) + 1 if lines else 0


def measured_seconds_per_sample(plan: Plan) -> float | None:
    """Mean wall seconds per trained sample over the plan's finished runs (None: none finished)."""
    rates = []
    for run in plan.runs:
        if is_done(run):
            info = json.loads((run.run_dir / DONE_FILE).read_text())
            rates.append(info["wall_s"] / max(1, run.num_steps * run.batch_size))
    return sum(rates) / len(rates) if rates else None


def estimate_seconds(plan: Plan, jobs: int) -> float:
    """Wall time of the runs not finished yet, spread over ``jobs`` parallel slots."""
    rate = measured_seconds_per_sample(plan)
    total = 0.0
    for run in plan.runs:
        if not is_done(run):
            samples = run.num_steps * run.batch_size
            total += samples * rate if rate is not None else plan.spec.startup_s + samples * plan.spec.seconds_per_sample
    return total / max(1, min(jobs, len(plan.runs) or 1))


def train_command(plan: Plan, run: PlannedRun) -> list[str]:
    cmd = [sys.executable, "-m", "sao_megatron.cli", "train", "--config", str(plan.base_path),
           "--run-dir", str(run.run_dir), "--resume", "auto"]
    for s in run.overrides:
        cmd += ["--set", s]
    return cmd


def _child_env(jobs: int) -> dict[str, str]:
    env = dict(os.environ)
    # Parallel runs share the cores: without a cap each one's torch would start a thread per core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    return env


def execute(plan: Plan, jobs: int, *, on_event: Callable[[str], None] = log.info,
            poll_s: float = 2.0) -> list[PlannedRun]:
    """Run every unfinished run, ``jobs`` at a time; returns the runs that failed."""
    pending = [r for r in plan.runs if not is_done(r)]
    running: list[tuple[PlannedRun, subprocess.Popen, float, object]] = []
    failed: list[PlannedRun] = []
    env = _child_env(jobs)
    try:
        _loop(plan, pending, running, failed, jobs, env, on_event, poll_s)
    finally:  # interrupted (Ctrl-C): stop the children; they resume from their checkpoints next time
        for run, proc, _, logf in running:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            logf.close()
    return failed


def _loop(plan: Plan, pending: list[PlannedRun], running: list, failed: list[PlannedRun], jobs: int,
          env: dict[str, str], on_event: Callable[[str], None], poll_s: float) -> None:
    while pending or running:
        while pending and len(running) < jobs:
            run = pending.pop(0)
            run.run_dir.mkdir(parents=True, exist_ok=True)
            logf = (run.run_dir / "train.log").open("a")
            proc = subprocess.Popen(train_command(plan, run), stdout=logf, stderr=subprocess.STDOUT, env=env)
            running.append((run, proc, time.monotonic(), logf))
            on_event(f"start {run.variant} seed {run.seed_index}: {run.num_steps} steps -> {run.run_dir}")
        time.sleep(poll_s)
        for item in list(running):
            run, proc, t0, logf = item
            if proc.poll() is None:
                continue
            running.remove(item)
            logf.close()
            wall = time.monotonic() - t0
            if proc.returncode == 0 and trained_steps(run) >= run.num_steps:
                (run.run_dir / DONE_FILE).write_text(json.dumps({"wall_s": wall, "num_steps": run.num_steps}))
                on_event(f"done  {run.variant} seed {run.seed_index} in {wall:.0f} s")
            else:
                failed.append(run)
                on_event(f"FAILED {run.variant} seed {run.seed_index} (exit {proc.returncode}); see "
                         f"{run.run_dir / 'train.log'}")
