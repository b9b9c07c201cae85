"""slurm/sao_rl.sbatch on the emulated cluster: 1 trainer node + 1 rollout node (embedded engine)."""

from __future__ import annotations

import re
import subprocess

import pytest

from slurm_helpers import (FINAL_STATES, TINY_OVERRIDES, assert_exactly_once, assert_run_complete,
                           latest_checkpoint, submit_sbatch, wait_for, wait_for_state, write_tiny_config)

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, slurm_cluster):
    """The tiny job submitted once, without engine weights (the job builds them): (run dir, job id, info)."""
    root = tmp_path_factory.mktemp("plain")
    run_dir = root / "run"
    job_id = submit_sbatch(run_dir, write_tiny_config(root / "tiny.yaml"))
    try:
        info = wait_for_state(job_id, FINAL_STATES, timeout_s=600)
    finally:
        subprocess.run(["scancel", job_id], check=False, timeout=60)
    return run_dir, job_id, info


def test_tiny_cpu_job_completes_on_two_nodes(plain_run):
    run_dir, job_id, info = plain_run
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


def test_engines_generate_with_the_trainers_weights_from_the_start(plain_run):
    """Engines on rollout nodes start from their own weights (here random ones); the trainer must load
    its version-0 export into them before the first rollout, or version-0 samples come from another
    policy (and after a requeue, from the start weights instead of the resumed actor)."""
    run_dir, job_id, info = plain_run
    rollout_log = (run_dir / "logs" / f"rollout-{job_id}-0.log").read_text()
    first_update = re.search(r"weights updated from \S+/weights/v(\d+)", rollout_log)
    assert first_update and int(first_update.group(1)) == 0, (
        "the engines never loaded the trainer's initial weights (weights/v000000): with "
        "rollout.engine=sglang the trainer must push them (update_weights_from_disk) after the health check")


def test_time_limit_then_preemption_resume_exactly_once(tmp_path, engine_dir, jobs):
    """Run 0 gets the time-limit signal (SIGUSR1 to the batch script, as --signal=B:USR1 sends it):
    the trainer checkpoints, exits and the job requeues itself. Run 1 is requeued from outside
    (`scontrol requeue`, SIGTERM everywhere). Run 2 finishes; no prompt is lost or trained twice."""
    num_steps = 16  # long enough that both interruptions land mid-run
    config = write_tiny_config(tmp_path / "tiny.yaml", run={"num_steps": num_steps})
    run_dir = tmp_path / "run"
    jobs.append(job_id := submit_sbatch(run_dir, config, env={"ENGINE_MODEL_DIR": str(engine_dir)}))
    train_log = run_dir / "logs" / f"train-{job_id}-0.log"

    wait_for(lambda: latest_checkpoint(run_dir) is not None, timeout_s=600, what="the first checkpoint")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, timeout=60)
    wait_for(lambda: len(resumes(train_log)) == 1, timeout_s=600, what="run 1 to resume")
    saved_on_signal = re.search(r"signal 10: checkpointed at step (\d+)", train_log.read_text())
    assert saved_on_signal, "the trainer did not checkpoint on the time-limit signal"
    assert resumes(train_log)[0] == int(saved_on_signal.group(1))  # resumed from exactly that checkpoint

    # Requeue run 1 once it has saved past its resume point.
    wait_for(lambda: checkpoint_step(run_dir) > resumes(train_log)[0], timeout_s=600, what="run 1 to save")
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
    info = wait_for_state(job_id, FINAL_STATES, timeout_s=900)
    out = (run_dir / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED", out
    assert info["Restarts"] == "2" and "restart 2" in out
    assert out.count("requeueing job") == 1  # the script requeued only on the time limit
    assert len(resumes(train_log)) == 2 and resumes(train_log)[1] > resumes(train_log)[0]
    state = assert_run_complete(run_dir, num_steps)
    assert_exactly_once(run_dir, state)


def resumes(train_log) -> list[int]:
    """Steps the trainer resumed from, in order."""
    text = train_log.read_text() if train_log.exists() else ""
    return [int(s) for s in re.findall(r"resumed from \S+ \(step (\d+)", text)]


def checkpoint_step(run_dir) -> int:
    ckpt = latest_checkpoint(run_dir)
    return int(ckpt.name.removeprefix("step_")) if ckpt else -1
