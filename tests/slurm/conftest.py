"""Fixtures for the tests on the real single-host Slurm cluster (scripts/slurm_cluster.sh).

The cluster is started here when it is not up yet (and then stopped at the end of the
session); CI starts it beforehand with `bash scripts/slurm_cluster.sh start`.
"""

from __future__ import annotations

import pathlib
import subprocess

import pytest

from slurm_helpers import CLUSTER, write_tiny_config


@pytest.fixture(scope="session")
def slurm_cluster():
    """The local cluster, started if needed (and then stopped again after the session)."""
    up = subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True, text=True, timeout=60)
    started = up.returncode != 0
    if started:
        subprocess.run(["bash", str(CLUSTER), "start"], check=True, timeout=600)
    yield
    if started:
        subprocess.run(["bash", str(CLUSTER), "stop"], check=False, timeout=300)


@pytest.fixture
def jobs(slurm_cluster):
    """Job ids a test submitted; whatever is still queued at teardown is cancelled."""
    ids: list[str] = []
    yield ids
    if ids:
        subprocess.run(["scancel", *ids], check=False, timeout=60)


@pytest.fixture
def tiny_config(tmp_path) -> pathlib.Path:
    return write_tiny_config(tmp_path / "tiny_test.yaml")


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory) -> pathlib.Path:
    """Engine start weights for the tiny model, built once (what a job builds itself when none is given)."""
    from sao_megatron.config import load_config
    from sao_megatron.launch.engine_init import write_bootstrap

    root = tmp_path_factory.mktemp("engine")
    out = root / "engine_init"
    write_bootstrap(load_config(write_tiny_config(root / "tiny.yaml"), check=False), out)
    return out
