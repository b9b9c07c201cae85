"""Two jobs on the same nodes at once: each owns its block of ports (launch/layout.py), nothing collides."""

from __future__ import annotations

import subprocess

import pytest

from sao_megatron.launch.layout import PORTS_PER_JOB, port_base
from slurm_helpers import (FINAL_STATES, assert_run_complete, job_info, job_nodes, submit_sbatch, wait_for,
                           wait_for_state, write_tiny_config)
from sockets import SocketMonitor, loopback_uses

pytestmark = pytest.mark.slurm

# The servers a layout starts and binds to ports of its job's block (gloo and srun take ephemeral ones).
BLOCK_SERVERS = ("serve-local", "torch.distributed.run", "sglang")


def test_two_jobs_share_two_nodes_without_port_collisions(tmp_path, engine_dir, jobs):
    """Both jobs put their trainer on the same node and their engine on the same other node
    (``--exclusive=user`` lets jobs of one user share nodes); both complete, each server listens inside
    its own job's block, and no (node, port) is listened on by both."""
    nodes = sorted(subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, check=True,
                                  timeout=60).stdout.split())[-2:]
    ids = []
    for name in ("a", "b"):
        config = write_tiny_config(tmp_path / f"{name}.yaml", run={"num_steps": 2, "sft_steps": 1})
        ids.append(submit_sbatch(tmp_path / name, config, env={"ENGINE_MODEL_DIR": str(engine_dir)},
                                 sbatch_args=("--exclusive=user", f"--nodelist={','.join(nodes)}")))
    jobs.extend(ids)
    with SocketMonitor(ids) as monitor:
        wait_for(lambda: all(job_info(j).get("JobState") == "RUNNING" for j in ids), timeout_s=120,
                 what="both jobs running at once")
        infos = [wait_for_state(j, FINAL_STATES, timeout_s=900) for j in ids]
    for name, job_id, info in zip("ab", ids, infos):
        assert info["JobState"] == "COMPLETED", (tmp_path / name / f"slurm-{job_id}.out").read_text()
        assert job_nodes(info) == nodes
        assert_run_complete(tmp_path / name, 2)
    assert port_base(int(ids[0])) != port_base(int(ids[1]))
    assert not loopback_uses(monitor.sockets)
    listeners = {}
    for s in monitor.sockets:
        if s.state == "LISTEN" and any(k in s.cmd for k in BLOCK_SERVERS):
            listeners.setdefault((s.node, s.local[1]), set()).add(s.job)
            assert port_base(int(s.job)) <= s.local[1] < port_base(int(s.job)) + PORTS_PER_JOB, s
    assert {frozenset(v) for v in listeners.values()} == {frozenset({ids[0]}), frozenset({ids[1]})}
    assert all(len(v) == 1 for v in listeners.values()), listeners
