"""Launcher environment parsing of the parallel bootstrap (torchrun, Slurm, single process)."""

from __future__ import annotations

import pytest

from sao_megatron import net
from sao_megatron.config.schema import ParallelConfig
from sao_megatron.parallel.bootstrap import (
    check_world_size,
    expand_first_host,
    first_slurm_host,
    launch_env,
    slurm_port,
)

pytestmark = pytest.mark.unit


def test_torchrun_variables_win():
    env = launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node7",
                      "MASTER_PORT": "29512", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.source) == (
        3, 8, 1, "node7", 29512, "torchrun")


def test_slurm_variables_with_node_list(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the own parser takes over
    env = launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                      "SLURM_JOB_NODELIST": "gpu[012-015,020],cpu1", "SLURM_JOB_ID": "4242"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.source) == (5, 8, 1, "gpu012", "slurm")
    assert env.master_port == slurm_port("4242")
    low, high = net.ephemeral_port_range()
    assert not low <= env.master_port <= high  # never a port the kernel may hand to a client socket
    block = net.port_base(4242, (low, high))
    assert block <= env.master_port < block + net.PORTS_PER_JOB  # inside the job's own port block
    assert slurm_port("4243") != env.master_port  # the next job does not collide


def test_slurm_master_port_override():
    env = launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1",
                      "MASTER_PORT": "23456", "MASTER_ADDR": "10.0.0.5"})
    assert (env.master_addr, env.master_port) == ("10.0.0.5", 23456)


def test_no_launcher_means_one_process_on_a_free_port():
    env = launch_env({})
    assert (env.rank, env.world_size, env.local_rank, env.source) == (0, 1, 0, "single")
    assert 0 < env.master_port < 65536


@pytest.mark.parametrize("nodelist, first", [("n1", "n1"), ("n[1-4]", "n1"), ("node[03,07-09]", "node03"),
                                             ("a,b", "a"), ("rack1-gpu[10-12],x", "rack1-gpu10")])
def test_expand_first_host(nodelist, first):
    assert expand_first_host(nodelist) == first


def test_first_slurm_host_without_scontrol(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert first_slurm_host("n[2-3]") == "n2"


def test_world_size_must_tile_the_layout():
    check_world_size(ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2), 4)
    with pytest.raises(ValueError, match="not divisible by TP\\*PP\\*CP=4"):
        check_world_size(ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 6)
    with pytest.raises(ValueError, match="expert-TP\\*EP\\*PP=8"):
        check_world_size(ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=4), 4)
