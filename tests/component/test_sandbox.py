"""The code sandbox: no network, nothing readable outside its directory, resource limits.

Run by the test process itself: ``namespace`` (root here and in CI) and the ``audit`` fallback
(accepted only with ``data.options.sandbox: unsafe``). The unprivileged ``userns`` mode, and
the escapes that defeat ``audit``, are tested as a non-root user in
``test_sandbox_unprivileged.py``. Each "cannot" test also runs the same code outside the sandbox
first, to prove that the resource really exists and is reachable (so the test can fail).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest

from sao_megatron.envs.sandbox import SandboxLimits, namespace_available, run_python

pytestmark = pytest.mark.component
MODES = ["namespace", "audit"] if namespace_available() else ["audit"]


@pytest.fixture
def listener():
    """A TCP server on the host's loopback that records connections."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    hits = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                hits.append(1)
                conn.close()
            except OSError:
                pass
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1], hits
    stop.set()
    t.join(2)
    srv.close()


CONNECT = """
import socket, sys
s = socket.socket()
s.settimeout(2)
s.connect(("127.0.0.1", {port}))
print("connected")
"""

# ctypes straight to libc: bypasses Python's audit hook, so only the network namespace stops it.
RAW_CONNECT = """
import ctypes, socket, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(2, 1, 0)
addr = struct.pack("<HH4s8x", 2, socket.htons({port}), bytes([127, 0, 0, 1]))
rc = libc.connect(fd, addr, len(addr))
print("fd", fd, "rc", rc, "errno", ctypes.get_errno())
"""


def _host_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)


@pytest.mark.parametrize("mode", MODES)
def test_sandbox_cannot_open_a_socket(mode, listener):
    port, hits = listener
    assert "connected" in _host_python(CONNECT.format(port=port)).stdout  # reachable from outside
    res = run_python(CONNECT.format(port=port), isolation=mode)
    assert res.returncode != 0 and "connected" not in res.stdout
    assert "PermissionError: sandbox: network access is disabled" in res.stderr
    assert len(hits) == 1  # only the host's own connection arrived


def test_network_namespace_stops_sockets_that_bypass_the_audit_hook(listener):
    if "namespace" not in MODES:
        pytest.fail("namespace isolation is unavailable: this test needs root (as here and in CI)")
    port, hits = listener
    host = _host_python(RAW_CONNECT.format(port=port)).stdout
    assert "rc 0" in host
    res = run_python(RAW_CONNECT.format(port=port), isolation="namespace")
    assert res.returncode == 0 and "rc -1" in res.stdout, res.stdout + res.stderr
    assert len(hits) == 1


@pytest.mark.parametrize("mode", MODES)
def test_sandbox_cannot_read_outside_its_directory(mode, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("top secret")
    os.chmod(tmp_path, 0o755)
    os.chmod(secret, 0o644)  # world-readable: only the sandbox stands in the way
    code = f"print(open({str(secret)!r}).read())"
    assert "top secret" in _host_python(code).stdout
    res = run_python(code, isolation=mode)
    assert res.returncode != 0 and "top secret" not in res.stdout
    for path in ("/etc/passwd", os.path.abspath(__file__)):
        res = run_python(f"print(open({path!r}).read()[:50])", isolation=mode)
        assert res.returncode != 0 and res.stdout == "", path
    res = run_python("import os; print(open('../../secret.txt').read())", isolation=mode)
    assert res.returncode != 0


@pytest.mark.parametrize("mode", MODES)
def test_sandbox_reads_and_writes_its_own_files(mode):
    res = run_python("d = open('data/in.txt').read(); open('out.txt', 'w').write(d.upper()); print(len(d))",
                     files={"data/in.txt": "hello"}, isolation=mode, collect=("out.txt",))
    assert res.ok and res.stdout.strip() == "5" and res.files == {"out.txt": b"HELLO"}
    assert res.isolation == mode


@pytest.mark.parametrize("mode", MODES)
def test_sandbox_limits_time_cpu_memory_and_output(mode):
    res = run_python("import time; time.sleep(30)", limits=SandboxLimits(wall_s=1.0), isolation=mode)
    assert res.timed_out and not res.ok
    # 1 s of CPU takes ~1 s wall alone but 10 s+ beside a CPU hog: the wall limit must stay far above it.
    res = run_python("while True: pass", limits=SandboxLimits(cpu_s=1, wall_s=60), isolation=mode)
    assert not res.timed_out and res.returncode < 0  # killed by RLIMIT_CPU (SIGXCPU/SIGKILL)
    res = run_python("x = bytearray(2 * 1024**3)", limits=SandboxLimits(memory_mb=256), isolation=mode)
    assert res.returncode != 0 and "MemoryError" in res.stderr
    res = run_python("print('x' * 10**6)", limits=SandboxLimits(max_output_bytes=100), isolation=mode)
    assert res.ok and len(res.stdout) == 100


def test_namespace_sandbox_runs_as_nobody_without_host_files():
    if "namespace" not in MODES:
        pytest.fail("namespace isolation is unavailable: this test needs root (as here and in CI)")
    res = run_python("import os; print(os.getuid(), os.getcwd(), sorted(os.listdir('/')))", isolation="namespace")
    uid, cwd, listing = res.stdout.split(" ", 2)
    assert (uid, cwd) == ("65534", "/work")
    for host_dir in ("etc", "home", "tmp", "proc"):
        assert f"'{host_dir}'" not in listing
