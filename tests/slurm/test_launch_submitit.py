"""`sao-megatron launch` (submitit) runs the same layout: 1 trainer node + 1 rollout node."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from slurm_helpers import (REPO, assert_exactly_once, assert_run_complete, job_info, latest_checkpoint,
                           wait_for, write_tiny_config)

pytestmark = pytest.mark.slurm


def test_tiny_cpu_job_via_submitit_survives_the_time_limit(tmp_path, engine_dir, jobs):
    """Submit with `--wait`; send the signal Slurm sends before the time limit (SIGURG, see
    launch/submit.py): submitit's Checkpointable has the trainer checkpoint, requeues the job,
    and the rerun resumes and finishes."""
    num_steps = 14
    config = write_tiny_config(tmp_path / "tiny.yaml", run={"num_steps": num_steps})
    run_dir = tmp_path / "run"
    stdout = tmp_path / "launch.out"
    with stdout.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "sao_megatron.cli", "launch", "--config", str(config),
                                 "--run-dir", str(run_dir), "--nodes-train", "1", "--nodes-rollout", "1",
                                 "--engine-model-dir", str(engine_dir), "--time", "20", "--signal-lead", "60",
                                 "--wait"], cwd=REPO, stdout=sink, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: "submitted job" in stdout.read_text() or proc.poll() is not None, timeout_s=120,
                 what="the job id")
        job_id = re.search(r"submitted job (\d+)", stdout.read_text()).group(1)
        jobs.append(job_id)
        wait_for(lambda: latest_checkpoint(run_dir) is not None, timeout_s=600, what="the first checkpoint")
        subprocess.run(["scancel", "--signal=URG", job_id], check=True, timeout=60)
        _, err = proc.communicate(timeout=900)
    finally:
        proc.kill()
    out = stdout.read_text()
    assert proc.returncode == 0, out + err
    assert f"{run_dir}/launch/submitit/{job_id}/{job_id}_0_log.out" in out  # log paths are printed
    info = job_info(job_id)
    assert info["NumNodes"] == "2" and info["Restarts"] == "1"
    log = (run_dir / "launch" / "submitit" / job_id / f"{job_id}_0_log.err").read_text()
    saved = re.search(r"signal 10: checkpointed at step (\d+)", log)
    assert saved, "the trainer did not checkpoint on the requeue signal"
    assert re.search(rf"resumed from \S+ \(step {saved.group(1)},", log)
    state = assert_run_complete(run_dir, num_steps)
    assert_exactly_once(run_dir, state)
