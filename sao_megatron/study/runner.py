"""Run a study plan: the warm-ups first (``sao-megatron sft``, one per warm-up seed), then one
``sao-megatron train`` subprocess per arm x (warm-up, RL seed), ``jobs`` at a time.

Each run owns its directory; a finished one has ``study_done.json`` there (its wall and CPU
seconds) and is skipped. An interrupted RL run resumes from its latest checkpoint (``--resume
auto``); an interrupted warm-up starts over (its partial actor is removed). So the same command continues a study. The estimate of
the remaining time uses the wall time per trained sample of the RL runs already finished, else the
study file's ``seconds_per_sample``, ``startup_s`` and ``warmup_s``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from sao_megatron.parallel.launcher_env import child_env
from sao_megatron.study.spec import Plan, PlannedRun, PlannedWarmup

log = logging.getLogger(__name__)
DONE_FILE = "study_done.json"


def is_done(run: PlannedRun | PlannedWarmup) -> bool:
    return (run.run_dir / DONE_FILE).is_file()


def trained_steps(run: PlannedRun) -> int:
    """Steps in the run's metrics.jsonl (a trainer stopped by a signal exits 0 before its last step)."""
    path = run.run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    return int(json.loads(lines[-1])["step"]) + 1 if lines else 0


def measured_seconds_per_sample(plan: Plan) -> float | None:
    """Mean wall seconds per trained sample over the plan's finished RL runs (None: none finished)."""
    rates = []
    for run in plan.runs:
        if is_done(run):
            info = json.loads((run.run_dir / DONE_FILE).read_text())
            rates.append(info["wall_s"] / max(1, run.num_steps * run.batch_size))
    return sum(rates) / len(rates) if rates else None


def measured_run_cost(plan: Plan) -> tuple[int, float, float]:
    """(finished RL runs, mean wall s, mean CPU s per run; NaN where none recorded one)."""
    infos = [json.loads((r.run_dir / DONE_FILE).read_text()) for r in plan.runs if is_done(r)]
    walls = [i["wall_s"] for i in infos]
    cpus = [i["cpu_s"] for i in infos if "cpu_s" in i]  # studies run before CPU time was recorded lack it
    return len(infos), sum(walls) / len(walls) if walls else math.nan, sum(cpus) / len(cpus) if cpus else math.nan


def estimate_seconds(plan: Plan, jobs: int) -> float:
    """Wall time of the runs (warm-ups included) not finished yet, spread over ``jobs`` parallel slots."""
    rate = measured_seconds_per_sample(plan)
    total = sum(plan.spec.warmup_s for w in plan.warmups if not is_done(w))
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


def warmup_command(plan: Plan, warmup: PlannedWarmup) -> list[str]:
    cmd = [sys.executable, "-m", "sao_megatron.cli", "sft", "--config", str(plan.base_path),
           "--run-dir", str(warmup.run_dir)]
    for s in warmup.overrides:
        cmd += ["--set", s]
    return cmd


def _child_env(jobs: int) -> dict[str, str]:
    env = child_env()  # each run is a world of its own: no launcher variables of ours (e.g. one MASTER_PORT)
    # Parallel runs share the cores: without a cap each one's torch would start a thread per core.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    return env


@dataclass(slots=True)
class _Job:
    """One subprocess of the study: its command, what counts as finished, and its name in the log."""

    name: str
    item: PlannedRun | PlannedWarmup
    command: list[str]
    finished: Callable[[], bool]


def _warmup_job(plan: Plan, w: PlannedWarmup) -> _Job:
    return _Job(f"warm-up w{w.index}", w, warmup_command(plan, w), lambda: (w.actor / "metadata.json").is_file())


def _run_job(plan: Plan, run: PlannedRun) -> _Job:
    return _Job(f"{run.variant} w{run.warmup_index} r{run.seed_index}", run, train_command(plan, run),
                lambda: trained_steps(run) >= run.num_steps)


def execute(plan: Plan, jobs: int, *, on_event: Callable[[str], None] = log.info, poll_s: float = 2.0,
            on_done: Callable[[PlannedRun | PlannedWarmup, dict], None] | None = None) -> list[PlannedRun | PlannedWarmup]:
    """Run every unfinished warm-up, then every unfinished RL run whose warm-up finished, ``jobs`` at a
    time, pair by pair (every arm's run of one (warm-up, RL seed) before the next pair's), so a study
    stopped part-way has whole pairs to compare; returns what failed (an RL run whose warm-up failed
    counts as failed, not started).
    ``on_done(item, done)``: called as each one finishes (``done``: its wall and CPU seconds)."""
    env = _child_env(jobs)
    on_done = on_done or (lambda item, done: None)
    failed = _run_jobs([_warmup_job(plan, w) for w in plan.warmups if not is_done(w)], jobs, env, on_event, poll_s,
                       on_done)
    bad = {w.index for w in failed}
    pending = sorted((r for r in plan.runs if not is_done(r)), key=lambda r: r.pair)  # stable: arm order within a pair
    failed += [r for r in pending if r.warmup_index in bad]
    jobs_rl = [_run_job(plan, r) for r in pending if r.warmup_index not in bad]
    return failed + _run_jobs(jobs_rl, jobs, env, on_event, poll_s, on_done)


def _run_jobs(todo: list[_Job], jobs: int, env: dict[str, str], on_event: Callable[[str], None],
              poll_s: float, on_done: Callable[[PlannedRun | PlannedWarmup, dict], None]) -> list:
    running: list[tuple[_Job, subprocess.Popen, float, object]] = []
    failed: list = []
    try:
        _loop(todo, running, failed, jobs, env, on_event, poll_s, on_done)
    finally:  # interrupted (Ctrl-C): stop the children; they resume from their checkpoints next time
        for _, proc, _, logf in running:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            logf.close()
    return failed


def _start(job: _Job, env: dict[str, str]) -> tuple[subprocess.Popen, object]:
    job.item.run_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(job.item, PlannedWarmup) and job.item.actor.exists():
        shutil.rmtree(job.item.actor)  # an interrupted warm-up's partial actor: sft saves into a fresh directory
    logf = (job.item.run_dir / ("sft.log" if isinstance(job.item, PlannedWarmup) else "train.log")).open("a")
    return subprocess.Popen(job.command, stdout=logf, stderr=subprocess.STDOUT, env=env), logf


def _reap(proc: subprocess.Popen) -> float | None:
    """None while ``proc`` runs; else its CPU seconds (user + system, with the descendants it waited
    for: the engine and the reward workers), which, unlike wall time, a shared machine does not inflate."""
    if proc.returncode is not None:  # reaped elsewhere: its usage is gone
        return math.nan
    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    if pid == 0:
        return None
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    return usage.ru_utime + usage.ru_stime


def _loop(todo: list[_Job], running: list, failed: list, jobs: int, env: dict[str, str],
          on_event: Callable[[str], None], poll_s: float,
          on_done: Callable[[PlannedRun | PlannedWarmup, dict], None]) -> None:
    todo = list(todo)
    while todo or running:
        while todo and len(running) < jobs:
            job = todo.pop(0)
            proc, logf = _start(job, env)
            running.append((job, proc, time.monotonic(), logf))
            steps = f": {job.item.num_steps} steps" if isinstance(job.item, PlannedRun) else ""
            on_event(f"start {job.name}{steps} -> {job.item.run_dir}")
        time.sleep(poll_s)
        for entry in list(running):
            job, proc, t0, logf = entry
            cpu = _reap(proc)
            if cpu is None:
                continue
            running.remove(entry)
            logf.close()
            wall = time.monotonic() - t0
            if proc.returncode == 0 and job.finished():
                done = {"wall_s": wall, "cpu_s": cpu}
                (job.item.run_dir / DONE_FILE).write_text(json.dumps(done))
                on_event(f"done  {job.name} in {wall:.0f} s (CPU {cpu:.0f} s)")
                on_done(job.item, done)
            else:
                failed.append(job.item)
                on_event(f"FAILED {job.name} (exit {proc.returncode}); see the log in {job.item.run_dir}")
