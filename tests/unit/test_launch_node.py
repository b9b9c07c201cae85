"""The per-node runner's helpers: health waits and the trainer/rollout split of an allocation."""

from __future__ import annotations

import http.server
import threading

import pytest

from sao_megatron.launch import node as nd
from sao_megatron import net
from sao_megatron.launch import layout as lp
from sao_megatron.launch.layout import LaunchPlan

pytestmark = pytest.mark.unit


@pytest.fixture
def health_server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_wait_healthy_returns_once_every_url_answers(health_server):
    nd.wait_healthy([health_server, health_server], timeout_s=5)


def test_wait_healthy_names_the_url_that_never_answered(health_server):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(TimeoutError, match=dead):
        nd.wait_healthy([health_server, dead], timeout_s=1.0)
    with pytest.raises(RuntimeError, match="exited"):
        nd.wait_healthy([dead], timeout_s=30, alive=lambda: False)


def test_endpoints_of_an_allocation():
    plan = LaunchPlan(config="/c.yaml", run_dir="/r", nodes_train=2, nodes_rollout=2, gpus_per_node=8,
                      gpus_per_engine=4)
    base = net.port_base(7, (32768, 60999))
    alloc = nd.Allocation(job_id=7, restart=0, train_addrs=["t0", "t1"], rollout_addrs=["r0", "r1"], port_base=base)
    urls, router = nd.endpoints(plan, alloc)
    assert urls == [f"http://r0:{base}", f"http://r0:{base + 1}", f"http://r1:{base + 2}", f"http://r1:{base + 3}"]
    assert router == f"http://r0:{base + lp.ROUTER_PORT_OFFSET}"
    single = LaunchPlan(config="/c.yaml", run_dir="/r", nodes_rollout=1)
    assert nd.endpoints(single, nd.Allocation(job_id=7, restart=0, train_addrs=["t0"], rollout_addrs=["r0"],
                                              port_base=base)) == ([f"http://r0:{base}"], None)


def test_trainer_runner_outlives_ranks_orphaned_by_torchrun():
    """If torchrun exits first, its ranks are re-parented to the runner, which waits for them: the
    runner's own exit would end the Slurm step and kill a rank mid-checkpoint. Run in a child
    process so that this test process does not become a subreaper."""
    import subprocess
    import sys

    script = """
import subprocess, sys, time
from sao_megatron.launch import node
node._become_subreaper()
# 'torchrun' stand-in: starts a 'rank' that outlives it by 1.5 s, then exits at once
first = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1.5)'])"])
t0 = time.monotonic()
code = node._reap_all(first, set())
print(code, round(time.monotonic() - t0, 1))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    code, waited = out.stdout.split()
    assert code == "0" and float(waited) >= 1.4
