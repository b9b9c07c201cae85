"""slurm/sao_rl.sbatch on the emulated cluster: 1 trainer node + 1 rollout node (embedded engine)."""

from __future__ import annotations

import re
import subprocess

import pytest

from slurm_helpers import (FINAL_STATES, TINY_OVERRIDES, assert_exactly_once, assert_run_complete,
                           latest_checkpoint, submit_sbatch, wait_for, wait_for_state, write_tiny_config)

pytestmark = pytest.mark.slurm


def test_tiny_cpu_job_completes_on_two_nodes(tmp_path, tiny_config, jobs):
    run_dir = tmp_path / "run"
    jobs.append(job_id := submit_sbatch(run_dir, tiny_config))
    info = wait_for_state(job_id, FINAL_STATES, timeout_s=600)
    assert info["JobState"] == "COMPLETED", (run_dir / f"slurm-{job_id}.out").read_text()
    assert info["NumNodes"] == "2" and info["Restarts"] == "0"
    state = assert_run_complete(run_dir, TINY_OVERRIDES["run"]["num_steps"])
    assert_exactly_once(run_dir, state)
    # The trainer (node 0) talked to the engine on the rollout node (node 1), not to engines of its own;
    # without model.hf_dir the job built the engines' start weights itself.
    train_log = (run_dir / "logs" / f"train-{job_id}-0.log").read_text()
    assert re.search(r'rollout\.engine_urls=\["http://127\.0\.0\.1:\d+"\]', train_log)
    rollout_log = (run_dir / "logs" / f"rollout-{job_id}-0.log").read_text()
    assert "serve-local --model-dir " + str(run_dir / "launch" / "engine_init") in rollout_log


def test_requeue_resumes_from_checkpoint_exactly_once(tmp_path, engine_dir, jobs):
    num_steps = 14  # long enough that the requeue lands mid-run
    config = write_tiny_config(tmp_path / "tiny.yaml", run={"num_steps": num_steps})
    run_dir = tmp_path / "run"
    jobs.append(job_id := submit_sbatch(run_dir, config, env={"ENGINE_MODEL_DIR": str(engine_dir)}))
    wait_for(lambda: latest_checkpoint(run_dir) is not None, timeout_s=600, what="the first checkpoint")
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
    requeued_at = latest_checkpoint(run_dir)
    info = wait_for_state(job_id, FINAL_STATES, timeout_s=600)
    out = (run_dir / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", out
    assert info["Restarts"] == "1" and "restart 1" in out
    train_log = (run_dir / "logs" / f"train-{job_id}-0.log").read_text()
    resumed = re.search(r"resumed from \S+step_(\d+) \(step (\d+)", train_log)
    assert resumed, "the requeued run did not resume from a checkpoint"
    assert 0 < int(resumed.group(2)) < num_steps and int(resumed.group(2)) >= int(requeued_at.name[5:])
    state = assert_run_complete(run_dir, num_steps)
    assert_exactly_once(run_dir, state)
