"""`sao-megatron launch` rejects bad input before anything reaches the queue."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slurm


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sao_megatron.cli", "launch", *args],
                          capture_output=True, text=True, timeout=120)


def queue_names() -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%j"], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.split()


@pytest.mark.parametrize("case", ["too_many_nodes", "missing_config", "unwritable_run_dir"])
def test_bad_input_fails_at_submit_time(case, tmp_path, tiny_config, slurm_cluster):
    total = int(subprocess.run(["sinfo", "-h", "-o", "%D"], capture_output=True, text=True, check=True,
                               timeout=60).stdout.split()[0])
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    args = {"config": str(tiny_config), "run": str(tmp_path / "run"), "train": "1"}
    expected = {
        "too_many_nodes": f"needs {total + 1} nodes",
        "missing_config": f"config file not found: {tmp_path / 'nope.yaml'}",
        "unwritable_run_dir": "is not writable",
    }[case]
    if case == "too_many_nodes":
        args["train"] = str(total)          # + 1 rollout node = one more than the partition has
    elif case == "missing_config":
        args["config"] = str(tmp_path / "nope.yaml")
    else:
        args["run"] = str(blocker / "run")  # root writes anywhere; a file in the path stops everyone
    name = f"sao-bad-{case}"
    proc = launch("--config", args["config"], "--run-dir", args["run"], "--nodes-train", args["train"],
                  "--nodes-rollout", "1", "--job-name", name)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "submitted job" not in proc.stdout and name not in queue_names()


def test_dry_run_prints_the_sbatch_and_submits_nothing(tmp_path, tiny_config, slurm_cluster):
    name = "sao-dry-run"
    proc = launch("--config", str(tiny_config), "--run-dir", str(tmp_path / "run"), "--nodes-train", "2",
                  "--nodes-rollout", "1", "--job-name", name, "--time", "1:30:00", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("#!/bin/bash")
    cpus = min(int(c) for c in subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True,
                                                check=True, timeout=60).stdout.split())
    for line in ("#SBATCH --nodes=3", "#SBATCH --time=90", f"#SBATCH --job-name={name}", "#SBATCH --requeue",
                 f"#SBATCH --cpus-per-task={cpus}"):  # a task per node gets the whole node's CPUs
        assert line in proc.stdout.splitlines()
    assert name not in queue_names()
