"""The emulated cluster's network identity (scripts/slurm_cluster.sh) and the loopback check itself."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import pytest

from slurm_helpers import CLUSTER, FINAL_STATES, node_addrs, wait_for, wait_for_state
from sockets import SocketMonitor, decode_address, loopback_uses, parse_tcp_table, process_sockets

def net_mode() -> str:
    return pathlib.Path("/var/lib/sao-slurm/run/net").read_text().strip()


@pytest.mark.slurm
def test_every_node_has_its_own_address_and_name(tmp_path, jobs, slurm_cluster):
    """Inside each node: the hostname is the node's name and resolves to its NodeAddr (not loopback), every
    other node's name to that node's NodeAddr; the nodes' addresses (and, with namespaces, their network
    namespaces) all differ."""
    addrs = node_addrs()
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent("""
        import json, os, socket, sys
        names = sys.argv[1].split(",")
        print(json.dumps({"node": os.environ["SLURMD_NODENAME"], "hostname": socket.gethostname(),
                          "netns": os.stat("/proc/self/ns/net").st_ino,
                          "resolves": {n: socket.gethostbyname(n) for n in names}}), flush=True)
    """))
    out = tmp_path / "out.txt"
    n = len(addrs)
    job = subprocess.run(["sbatch", "--parsable", f"--nodes={n}", f"--output={out}", "--wrap",
                          f"srun --nodes={n} --ntasks={n} {sys.executable} {probe} {','.join(addrs)}"],
                         capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    jobs.append(job)
    assert wait_for_state(job, FINAL_STATES, timeout_s=120)["JobState"] == "COMPLETED", out.read_text()
    seen = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    assert sorted(s["node"] for s in seen) == sorted(addrs)
    assert len(set(addrs.values())) == len(addrs), addrs
    for s in seen:
        assert s["hostname"] == s["node"]
        assert s["resolves"] == addrs, s  # own name included: never 127.0.0.1 / 127.0.1.1
        assert s["resolves"][s["node"]] not in ("127.0.0.1", "127.0.1.1")
    if net_mode() == "netns":
        assert len({s["netns"] for s in seen}) == len(addrs)
        assert all(not a.startswith("127.") for a in addrs.values())


@pytest.mark.slurm
def test_the_loopback_check_catches_a_job_that_uses_loopback(tmp_path, jobs, slurm_cluster):
    """The check the layout tests rely on must fail on a job that listens on and dials 127.0.0.1, and
    see the same job's socket on its node address."""
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent("""
        import socket, time
        own = socket.gethostbyname(socket.gethostname())
        lo = socket.create_server(("127.0.0.1", 0)); ok = socket.create_server((own, 0))
        c = socket.create_connection(lo.getsockname()); time.sleep(8)
    """))
    job = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--output=/dev/null", "--wrap",
                          f"{sys.executable} {script}"], capture_output=True, text=True, check=True,
                         timeout=60).stdout.strip()
    jobs.append(job)
    with SocketMonitor([job], interval_s=0.3) as mon:
        wait_for(lambda: len(mon.sockets) >= 3, timeout_s=60, what="the job's sockets")
    looped = loopback_uses(mon.sockets)
    assert {s.state for s in looped} == {"LISTEN", "ESTABLISHED"}
    node = looped[0].node
    assert {s.local[0] for s in mon.sockets if s.state == "LISTEN"} == {"127.0.0.1", node_addrs()[node]}


@pytest.mark.unit
def test_tcp_table_parser_agrees_with_the_sockets_it_reads():
    """Reference: the addresses Python's own sockets report, found again in /proc/<pid>/net/tcp{,6}."""
    mine = [socket.create_server(("127.0.0.1", 0))]
    if socket.has_ipv6:
        try:
            mine.append(socket.create_server(("::1", 0), family=socket.AF_INET6))
        except OSError:
            pass
    client = socket.create_connection(mine[0].getsockname()[:2])
    try:
        seen = {(s.state, s.local, s.remote) for s in process_sockets(os.getpid(), "here")}
        for srv in mine:
            host, port = srv.getsockname()[:2]
            assert ("LISTEN", (host, port), ("::", 0) if ":" in host else ("0.0.0.0", 0)) in seen
        assert ("ESTABLISHED", client.getsockname(), client.getpeername()) in seen
    finally:
        client.close()
        for srv in mine:
            srv.close()
    assert decode_address("0100007F:1F90") == ("127.0.0.1", 8080)
    assert parse_tcp_table("hdr\n 0: 0B4D0A0A:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 4242 1\n") == {
        4242: ("LISTEN", ("10.10.77.11", 80), ("0.0.0.0", 0))}


@pytest.mark.slurm
def test_start_is_idempotent_and_stop_leaves_nothing_behind(slurm_cluster):
    """A second start changes nothing; stop removes every namespace, link and daemon; start brings it back."""
    before = node_addrs()
    subprocess.run(["bash", str(CLUSTER), "start"], check=True, timeout=300)
    assert node_addrs() == before
    subprocess.run(["bash", str(CLUSTER), "stop"], check=True, timeout=300)
    try:
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=60).stdout
        assert not [line for line in netns.splitlines() if line.startswith("sao-n")], netns
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=60).stdout
        assert "saobr0" not in links and " sao-n" not in links, links
        assert not [p for p in pathlib.Path("/var/lib/sao-slurm/run").glob("*.pid")]
    finally:
        subprocess.run(["bash", str(CLUSTER), "start"], check=True, timeout=300)
    assert node_addrs() == before
