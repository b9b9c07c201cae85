"""Two jobs on the same nodes at once: each owns its block of ports (launch/layout.py), outside the nodes'
ephemeral port range, and nothing collides."""

from __future__ import annotations

import subprocess

import pytest

from sao_megatron.net import PORTS_PER_JOB, port_base
from slurm_helpers import (FINAL_STATES, assert_run_complete, job_info, job_nodes, node_ephemeral_range, node_netns,
                           set_node_ephemeral_range, submit_sbatch, wait_for, wait_for_state, write_tiny_config)
from sockets import SocketMonitor, loopback_uses

pytestmark = pytest.mark.slurm

# The servers a layout starts and binds to ports of its job's block (gloo and srun take ephemeral ones).
BLOCK_SERVERS = ("serve-local", "torch.distributed.run", "sglang")


# Narrowed on the test's nodes (inside their namespaces): the blocks below 61000 all meet it, so a node
# runner that did not read its own node's range would pick a block the kernel hands to client sockets.
NARROW_EPHEMERAL = (20000, 60999)


@pytest.fixture
def narrowed_nodes(slurm_cluster):
    """The two nodes the test shares, with NARROW_EPHEMERAL where they have their own namespace (restored after)."""
    nodes = sorted(subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, check=True,
                                  timeout=60).stdout.split())[-2:]
    before = {n: node_ephemeral_range(n) for n in nodes}
    try:
        for n in nodes:
            if node_netns(n):
                set_node_ephemeral_range(n, NARROW_EPHEMERAL)
        yield nodes
    finally:
        for n, old in before.items():
            if node_netns(n):
                set_node_ephemeral_range(n, old)


def test_two_jobs_share_two_nodes_without_port_collisions(tmp_path, engine_dir, jobs, narrowed_nodes):
    """Both jobs put their trainer on the same node and their engine on the same other node
    (``--exclusive=user`` lets jobs of one user share nodes); both complete, each server listens inside
    its own job's block, which lies outside the node's ephemeral port range, and no (node, port) is
    listened on by both."""
    nodes = narrowed_nodes
    ephemeral = {n: node_ephemeral_range(n) for n in nodes}
    assert len(set(ephemeral.values())) == 1, ephemeral  # the nodes of a job must agree on their block
    ephemeral = ephemeral[nodes[0]]
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
    bases = {j: port_base(int(j), ephemeral) for j in ids}
    assert bases[ids[0]] != bases[ids[1]]
    assert not loopback_uses(monitor.sockets)
    listeners = {}
    for s in monitor.sockets:
        if s.state == "LISTEN" and any(k in s.cmd for k in BLOCK_SERVERS):
            listeners.setdefault((s.node, s.local[1]), set()).add(s.job)
            assert bases[s.job] <= s.local[1] < bases[s.job] + PORTS_PER_JOB, s
            assert not ephemeral[0] <= s.local[1] <= ephemeral[1], s
    assert {frozenset(v) for v in listeners.values()} == {frozenset({ids[0]}), frozenset({ids[1]})}
    assert all(len(v) == 1 for v in listeners.values()), listeners
