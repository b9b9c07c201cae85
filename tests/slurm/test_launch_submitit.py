"""`sao-megatron launch` (submitit) runs the same layout: 1 trainer node + 1 rollout node."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from slurm_helpers import REPO, TINY_OVERRIDES, assert_exactly_once, assert_run_complete, job_info

pytestmark = pytest.mark.slurm
NUM_STEPS = TINY_OVERRIDES["run"]["num_steps"]


def test_tiny_cpu_job_via_submitit(tmp_path, tiny_config, engine_dir, jobs):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "sao_megatron.cli", "launch", "--config", str(tiny_config),
                             "--run-dir", str(run_dir), "--nodes-train", "1", "--nodes-rollout", "1",
                             "--engine-model-dir", str(engine_dir), "--time", "20", "--signal-lead", "60",
                             "--wait"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    job_id = re.search(r"submitted job (\d+)", out).group(1)
    jobs.append(job_id)
    assert proc.returncode == 0, out + err
    assert f"{run_dir}/launch/submitit/{job_id}/{job_id}_0_log.out" in out  # log paths are printed
    assert job_info(job_id)["NumNodes"] == "2"
    state = assert_run_complete(run_dir, NUM_STEPS)
    assert_exactly_once(run_dir, state)
