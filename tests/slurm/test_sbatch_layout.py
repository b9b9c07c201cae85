"""slurm/sao_rl.sbatch on the emulated cluster, each node with its own address: 2 trainer nodes
(torchrun, 2 ranks each: TP2 inside a node x DP2 across nodes, gloo between them) + 1 rollout node
(embedded engine + sglang-router).

The plain run syncs weights with ``rollout.weight_sync.transport=distributed`` and EP2 (the experts' second
EP rank lives on trainer node 1), so both trainer nodes host update groups that the engine on the
rollout node joins across hosts; the requeue run keeps the default disk sync."""

from __future__ import annotations

import ipaddress
import re
import subprocess

import pytest

from slurm_helpers import (FINAL_STATES, TINY_OVERRIDES, assert_exactly_once, assert_run_complete, job_nodes,
                           latest_checkpoint, node_addrs, read_jsonl, submit_multihost, wait_for, wait_for_state,
                           write_multihost_config)
from sockets import SocketMonitor, loopback_uses

pytestmark = pytest.mark.slurm


# EP2 over the DP dimension: EP rank 1 (ranks 2-3) is on trainer node 1 and sends its experts itself.
PLAIN_PARALLEL = {"expert_model_parallel_size": 2}


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, slurm_cluster):
    """The job submitted once, without engine weights (the job builds them), its sockets sampled on
    every node while it runs: (run dir, job id, info, monitor)."""
    root = tmp_path_factory.mktemp("plain")
    run_dir = root / "run"
    config = write_multihost_config(root / "tiny.yaml", parallel=PLAIN_PARALLEL,
                                    rollout={"weight_sync": {"transport": "distributed"}})
    job_id = submit_multihost(run_dir, config)
    try:
        with SocketMonitor([job_id]) as monitor:
            info = wait_for_state(job_id, FINAL_STATES, timeout_s=900)
    finally:
        subprocess.run(["scancel", job_id], check=False, timeout=60)
    return run_dir, job_id, info, monitor


def layout_addrs(info) -> tuple[list[str], str]:
    """(trainer node addresses, rollout node address) of the job, from Slurm's NodeAddr."""
    addrs = node_addrs()
    nodes = [addrs[n] for n in job_nodes(info)]
    return nodes[:2], nodes[2]


def test_tiny_cpu_job_completes_on_three_nodes(plain_run):
    run_dir, job_id, info, _ = plain_run
    assert info["JobState"] == "COMPLETED", (run_dir / f"slurm-{job_id}.out").read_text()
    assert info["NumNodes"] == "3" and info["Restarts"] == "0"
    state = assert_run_complete(run_dir, TINY_OVERRIDES["run"]["num_steps"])
    assert_exactly_once(run_dir, state)
    # The trainer talked to the router on the rollout node through that node's own address; the
    # rendezvous is on trainer node 0's address; without model.hf_dir the job built the engines' weights.
    (train0, train1), rollout = layout_addrs(info)
    train_log = (run_dir / "logs" / f"train-{job_id}-0.log").read_text()
    assert re.search(rf'rollout\.engine_urls=\["http://{re.escape(rollout)}:\d+"\]', train_log)
    assert f"rollout.router_url=http://{rollout}:" in train_log
    for node in (0, 1):
        log = (run_dir / "logs" / f"train-{job_id}-{node}.log").read_text()
        assert f"--master-addr={train0} " in log and f"--local-addr={(train0, train1)[node]} " in log
        # TP inside the node, DP (and EP) across the nodes: node 1 holds DP rank 1 of both TP ranks.
        assert sorted(re.findall(rf"tp (\d)/2 pp 0/1 ep {node}/2 etp \d/2 dp (\d)/2", log)) == [("0", str(node)),
                                                                                                  ("1", str(node))]
    rollout_log = (run_dir / "logs" / f"rollout-{job_id}-0.log").read_text()
    assert "serve-local --model-dir " + str(run_dir / "launch" / "engine_init") in rollout_log


def test_it_learns(plain_run):
    """The supervised warm-up runs through the same TP2 x DP2 update: its loss drops on the same batches'
    distribution (4.84 -> 4.37 measured; ln(128) = 4.85 at random initialisation)."""
    run_dir, job_id, _, _ = plain_run
    log = (run_dir / "logs" / f"train-{job_id}-0.log").read_text()
    losses = [float(x) for x in re.findall(r"supervised warm-up \d+/\d+: loss ([\d.]+)", log)]
    assert len(losses) == TINY_OVERRIDES["run"]["sft_steps"], log[-3000:]
    assert losses[-1] < 0.95 * losses[0], losses


def test_no_component_listens_on_or_dials_loopback(plain_run):
    """Every socket of every process of the job, on every node: none on 127.0.0.1; gloo runs between the two
    trainer nodes' addresses, the ranks reach the router on the rollout node, and every rank, engine and
    router got GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME = the interface of its node address."""
    run_dir, job_id, info, monitor = plain_run
    socks = monitor.sockets
    assert socks, "the monitor saw no socket of the job"
    looped = loopback_uses(socks)
    assert not looped, "\n".join(f"{s.node} {s.state} {s.local}->{s.remote} {s.cmd}" for s in looped)
    (train0, train1), rollout = layout_addrs(info)
    train_log = (run_dir / "logs" / f"train-{job_id}-0.log").read_text()
    router = (rollout, int(re.search(rf"rollout\.router_url=http://{re.escape(rollout)}:(\d+)", train_log).group(1)))
    ranks = [s for s in socks if "train_entry" in s.cmd and s.state == "ESTABLISHED"]
    assert {(s.local[0], s.remote[0]) for s in ranks} >= {(train0, train1), (train1, train0)}  # gloo, both ways
    assert {s.local[0] for s in ranks if s.remote == router} == {train0}  # rank 0 drives the rollouts
    assert any(s.state == "LISTEN" and s.local == router for s in socks)
    iface = "lo" if train0.startswith("127.") else "eth0"
    nodes = dict(zip(job_nodes(info), ("train", "train", "rollout")))
    started = {(nodes.get(node), "train_entry" if "train_entry" in cmd else "engine"): env
               for (node, cmd), env in monitor.environ.items() if "train_entry" in cmd or "serve-local" in cmd}
    assert set(started) == {("train", "train_entry"), ("rollout", "engine")}, list(monitor.environ)
    for (node, cmd), env in monitor.environ.items():
        if "train_entry" in cmd or "serve-local" in cmd or "launch_router" in cmd:
            assert env == {"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface}, (node, cmd)


def test_distributed_weight_sync_crosses_hosts(plain_run):
    """Both trainer nodes send (EP rank 0 on node 0, EP rank 1 on node 1), each from a TCP store it hosts
    on its own node address, which the engine on the rollout node dials; every push reaches the engine,
    the first one is verified by checksums, the engine's weight version advances with the trainer's
    (the versions it stamps on generated tokens), and no trained sample is staler than the limit."""
    run_dir, job_id, info, monitor = plain_run
    assert info["JobState"] == "COMPLETED", (run_dir / f"slurm-{job_id}.out").read_text()
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "weight_sync/num_senders" in r]
    # Every step's row carries its own push (overlapped: the row waits for it), the last one's too.
    assert len(rows) == TINY_OVERRIDES["run"]["num_steps"], f"{len(rows)} distributed pushes logged"
    assert [r["weight_sync/verified"] for r in rows[:2]] == [1.0, 0.0]  # a mismatch would have stopped the run
    for r in rows:
        assert r["weight_sync/num_senders"] == 2 and r["weight_sync/failed_engines"] == 0, r
        assert r["weight_sync/bytes"] == r["weight_sync/engine_bytes"] > 0, r  # one engine: each byte once
    limit = 1  # configs/experiments/tiny_cpu.yaml scheduler.max_staleness
    trained = [r for r in read_jsonl(run_dir / "audit.jsonl") if r.get("phase") != "sft"]
    assert all(0 <= r["version"] - r["oldest_version"] <= limit for r in trained), trained
    # Only version 0 reaches the engine from disk (its start weights): later versions came over the groups.
    newest = max(r["version"] for r in trained)
    assert newest >= TINY_OVERRIDES["run"]["num_steps"] - 1 - limit
    assert max(r["oldest_version"] for r in trained) >= newest - limit >= 2
    (train0, train1), rollout = layout_addrs(info)
    addr_of = node_addrs()

    def reached_at(s):  # torch's TCPStore listens on every address: the engine reaches it at its node's
        wildcard = ipaddress.ip_address(s.local[0]).is_unspecified
        return (addr_of[s.node] if wildcard else s.local[0], s.local[1]), wildcard

    listening = dict(reached_at(s) for s in monitor.sockets if "train_entry" in s.cmd and s.state == "LISTEN")
    dialled = {s.remote: listening[s.remote] for s in monitor.sockets if "serve-local" in s.cmd
               and s.state == "ESTABLISHED" and s.local[0] == rollout and s.remote in listening}
    stores = {addr for (addr, _), wildcard in dialled.items() if wildcard}
    assert stores == {train0, train1}, (listening, dialled)  # the senders' group stores, one per trainer node
    assert {addr for addr, _ in dialled} == {train0, train1}
    assert not loopback_uses(monitor.sockets)


def test_engines_generate_with_the_trainers_weights_from_the_start(plain_run):
    """Engines on rollout nodes start from their own weights (here random ones); the trainer must load
    its version-0 export into them before the first rollout, or version-0 samples come from another
    policy (and after a requeue, from the start weights instead of the resumed actor)."""
    run_dir, job_id, info, _ = plain_run
    rollout_log = (run_dir / "logs" / f"rollout-{job_id}-0.log").read_text()
    first_update = re.search(r"weights updated from \S+/weights/v(\d+)", rollout_log)
    assert first_update and int(first_update.group(1)) == 0, (
        "the engines never loaded the trainer's initial weights (weights/v000000): with "
        "rollout.engine=sglang the trainer must push them (update_weights_from_disk) after the health check")


# Three runs of the job, each starting 4 ranks and an engine: ~10 min on 2 idle cores, past the default
# 900 s per test on a loaded box (measured 900+ s at load average 35, killed one step before the end).
@pytest.mark.timeout(1800)
def test_time_limit_then_preemption_resume_exactly_once(tmp_path, engine_dir, jobs):
    """Run 0 gets the time-limit signal (SIGUSR1 to the batch script, as --signal=B:USR1 sends it):
    the trainer checkpoints, exits and the job requeues itself. Run 1 is requeued from outside
    (`scontrol requeue`, SIGTERM everywhere). Run 2 finishes; no prompt is lost or trained twice."""
    num_steps = 16  # long enough that both interruptions land mid-run
    config = write_multihost_config(tmp_path / "tiny.yaml", run={"num_steps": num_steps})
    run_dir = tmp_path / "run"
    jobs.append(job_id := submit_multihost(run_dir, config, env={"ENGINE_MODEL_DIR": str(engine_dir)}))
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
