"""Known escapes against the sandbox, run as a non-root user (``unprivileged.py``).

Each attack program first runs outside the sandbox as the same user (the control: it must reach
the secret file, the writable directory, the listener or the process table), then inside the
sandbox, where it must not. The ``userns`` mode is the one a non-root trainer gets; ``namespace``
(root) runs the same attacks as root where the tests run as root. The attack scripts run under
``prlimit`` and ``timeout`` (see ``unprivileged.py``), and afterwards no process of the test uid
may be left.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import socket
import subprocess
import sys
import threading

import pytest
from unprivileged import REPO, TEST_UID, make_user_dir, processes_of, run_unprivileged

pytestmark = pytest.mark.component
# The root mode is also covered by test_sandbox.py; here it runs with the slow tests.
MODES = ["userns"] + ([pytest.param("namespace", marks=pytest.mark.slow)] if os.geteuid() == 0 else [])

# Runs outside the sandbox (as the test user): every attack inside the sandbox, and the controls.
DRIVER = r'''
import json, os, subprocess, sys, tempfile
from sao_megatron.envs.sandbox import SandboxLimits, run_python
cfg = json.loads(CFG)
def outcome(rc, out, err, timed_out=False):
    return {"rc": rc, "out": out[-3000:], "out_len": len(out), "err": err[-3000:], "timed_out": timed_out}
def control(code):
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=tempfile.mkdtemp())
    return outcome(r.returncode, r.stdout, r.stderr)
sibling = subprocess.Popen(["sleep", "120"])  # a process of the same user that the sandbox must not reach
report = {}
for name, code in cfg["attacks"].items():
    limits = SandboxLimits(**cfg["limits"].get(name, cfg["limits"]["default"]))
    res = run_python(code, isolation=cfg["mode"], limits=limits)
    leaked = [p for p in cfg["watch"] if os.path.exists(p)]  # before the control writes them
    report[name] = {"sandbox": outcome(res.returncode, res.stdout, res.stderr, res.timed_out), "leaked": leaked,
                    "started": res.stdout.startswith("STARTED\n"),
                    "control": control(code) if name in cfg["controlled"] else None}
    for p in cfg["watch"]:
        if os.path.exists(p):
            os.remove(p)
report["sibling_alive"] = sibling.poll() is None
sibling.kill()
sibling.wait()
print("REPORT " + json.dumps(report))
'''

# What an escaped program does: read the secret, write next to it, connect to the listener.
PAYLOAD = """
import socket
try:
    print("READ:" + open(SECRET).read(), flush=True)
except Exception as e:
    print("read failed:", e, flush=True)
try:
    open(WRITE, "w").write("escaped")
    print("WROTE", flush=True)
except Exception as e:
    print("write failed:", e, flush=True)
try:
    socket.create_connection(("127.0.0.1", PORT), timeout=2)
    print("CONNECTED", flush=True)
except Exception as e:
    print("connect failed:", e, flush=True)
"""

ATTACKS = {
    "in_process": "{payload}",
    "ctypes_syscalls": """
import ctypes, socket, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.open(SECRET.encode(), 0)
buf = ctypes.create_string_buffer(256)
n = libc.read(fd, buf, 255) if fd >= 0 else 0
print("READ:" + buf.raw[:max(n, 0)].decode(), flush=True)
if libc.open(WRITE.encode(), 0o101, 0o644) >= 0:
    print("WROTE", flush=True)
s = libc.socket(2, 1, 0)
addr = struct.pack("<HH4s8x", 2, socket.htons(PORT), bytes([127, 0, 0, 1]))
if libc.connect(s, addr, len(addr)) == 0:
    print("CONNECTED", flush=True)
""",
    "posixsubprocess_fork_exec": """
import _posixsubprocess, os, sys
for argv in ([sys.executable, "-c", PAYLOAD], ["/bin/cat", SECRET], ["/usr/bin/id"]):
    try:
        pid = _posixsubprocess.fork_exec(argv, [os.fsencode(argv[0])], True, (), None, None, -1, -1, -1, -1,
                                         -1, -1, *os.pipe(), False, False, -1, None, None, None, -1, None, True)
        print("ran", argv[0], os.waitpid(pid, 0)[1], flush=True)
    except Exception as e:
        print("spawn failed:", argv[0], e, flush=True)
""",
    "posix_spawn": """
import os, sys
for argv in ([sys.executable, "-c", PAYLOAD], ["/bin/cat", SECRET], ["/usr/bin/id"]):
    try:
        print("ran", argv[0], os.waitpid(os.posix_spawn(argv[0], argv, {}), 0)[1], flush=True)
    except Exception as e:
        print("spawn failed:", argv[0], e, flush=True)
""",
    "ctypes_system_and_execv": """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
print("system", libc.system(("/bin/cat " + SECRET + "; /usr/bin/id").encode()), flush=True)
argv = (ctypes.c_char_p * 4)(sys.executable.encode(), b"-c", PAYLOAD.encode(), None)
libc.execv(sys.executable.encode(), argv)
print("execv failed", ctypes.get_errno(), flush=True)
""",
    "fork_then_exec": """
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, "-c", PAYLOAD])
print("child", os.waitpid(pid, 0)[1], flush=True)
""",
    # A new user namespace would give back every capability, and with it the old chroot escape.
    "nested_userns_chroot_escape": """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x10000000) == 0:
    print("UNSHARED", flush=True)
    os.makedirs("jail", exist_ok=True)
    os.chroot("jail")
    os.chdir("../" * 32)
    os.chroot(".")
    print("READ:" + open(SECRET).read(), flush=True)
else:
    print("unshare failed", ctypes.get_errno(), flush=True)
""",
    "write_outside_workdir": """
import os, sys
for d in ("/", "/usr/lib", "/dev", "/work/..", sys.prefix, os.path.dirname(WRITE)):
    try:
        open(os.path.join(d, "sao-sandbox-escape"), "w").write("x")
        print("WROTE", d, flush=True)
    except Exception as e:
        print("write failed:", d, e, flush=True)
""",
    "kill_every_process": "import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('KILLED', flush=True)",
    # A daemon in its own session leaves the process group that the wall-time kill reaches.
    "daemon_outlives_the_run": """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.close(1), os.close(2)
        time.sleep(120)
    os._exit(0)
print("DAEMONIZED", flush=True)
""",
    # The program itself leaves the process group and hangs: the wall-time kill must still reach it.
    "setsid_and_hang": "import os, time\nos.setsid()\ntime.sleep(600)",
}
HANGS = ("setsid_and_hang",)
# kill(-1) outside would take the driver down with it, the daemon would outlive it: no control run.
CONTROLLED = [name for name in ATTACKS if name not in ("kill_every_process", "write_outside_workdir",
                                                       "daemon_outlives_the_run", *HANGS)]


@pytest.fixture(scope="module")
def listener():
    """A TCP server on the host's loopback that counts connections."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.2)
    hits, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                srv.accept()[0].close()
                hits.append(1)
            except OSError:
                pass
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield srv.getsockname()[1], hits
    stop.set()
    thread.join(2)
    srv.close()


def _prelude(secret: pathlib.Path, write: pathlib.Path, port: int, code: str) -> str:
    consts = f"SECRET = {str(secret)!r}\nWRITE = {str(write)!r}\nPORT = {port}\n"
    # STARTED proves that the sandbox ran the attack (a sandbox that cannot start contains everything).
    return (f"print('STARTED', flush=True)\n{consts}PAYLOAD = {consts + PAYLOAD!r}\n"
            + code.replace("{payload}", PAYLOAD))


def run_attacks(mode: str, attacks: dict[str, str], controlled: list[str], limits: dict, *,
                port: int, timeout_s: float = 240.0) -> tuple[dict, pathlib.Path, str]:
    """Run ``attacks`` in the sandbox (``mode``) and the controls as the test user -> (report, dir, secret)."""
    home = make_user_dir()
    secret, token = home / "secret.txt", secrets.token_hex(8)
    secret.write_text(token)
    os.chown(secret, TEST_UID, TEST_UID)
    os.chmod(secret, 0o600)
    write = home / "written.txt"
    cfg = {"mode": mode, "limits": limits, "controlled": controlled,
           "watch": [str(write), str(home / "sao-sandbox-escape")],
           "attacks": {k: _prelude(secret, write, port, v) for k, v in attacks.items()}}
    driver = DRIVER.replace("CFG", repr(json.dumps(cfg)))
    if mode == "namespace":  # the root mode: the driver runs as root, under the same outer limits
        proc = subprocess.run(["prlimit", "--nproc=512", "--as=4294967296", "--core=0", "--", "timeout", "-s", "KILL",
                               str(int(timeout_s)), sys.executable, "-c", driver], capture_output=True, text=True, timeout=timeout_s + 30,
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    else:
        proc = run_unprivileged(driver, timeout_s=timeout_s)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("REPORT ")), None)
    if line is None:
        subprocess.run(["rm", "-rf", str(home)], check=False)
        pytest.fail(f"the driver did not report (rc {proc.returncode}): {proc.stderr[-3000:]}")
    if mode != "namespace":  # the driver is done: daemons, bombs and sleepers must be gone as well
        assert processes_of(TEST_UID) == [], "a process of the test user outlived the sandbox"
    return json.loads(line[len("REPORT "):]), home, token


@pytest.fixture(scope="module", params=MODES)
def escapes(request, listener):
    port, hits = listener
    before = len(hits)
    limits = {"default": {"wall_s": 20.0, "cpu_s": 5, "memory_mb": 512}, "setsid_and_hang": {"wall_s": 2.0}}
    report, home, token = run_attacks(request.param, ATTACKS, CONTROLLED, limits, port=port)
    yield request.param, report, home, token, len(hits) - before
    subprocess.run(["rm", "-rf", str(home)], check=False)


def test_controls_reach_everything_outside_the_sandbox(escapes):
    mode, report, home, token, hits = escapes
    for name in CONTROLLED:  # root loses its access to the user's file in a new user namespace
        if name == "nested_userns_chroot_escape" and mode == "namespace":
            continue
        out = report[name]["control"]["out"]
        assert f"READ:{token}" in out, (name, report[name]["control"])
    for name in ("in_process", "ctypes_syscalls", "posixsubprocess_fork_exec", "posix_spawn", "fork_then_exec"):
        out = report[name]["control"]["out"]
        assert "WROTE" in out and "CONNECTED" in out, (name, out)
    assert "uid=" in report["posix_spawn"]["control"]["out"]  # /usr/bin/id ran
    assert "UNSHARED" in report["nested_userns_chroot_escape"]["control"]["out"]


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_is_contained(escapes, name):
    mode, report, home, token, _ = escapes
    res = report[name]["sandbox"]
    assert report[name]["started"], (mode, name, res)
    assert token not in res["out"] + res["err"], (mode, name, res)
    assert "WROTE" not in res["out"] and "CONNECTED" not in res["out"] and "UNSHARED" not in res["out"], res
    assert "uid=" not in res["out"], res
    assert report[name]["leaked"] == [], (mode, name, report[name]["leaked"])
    assert res["timed_out"] == (name in HANGS), res
    assert report["sibling_alive"], "kill(-1) in the sandbox reached a process outside it"


def test_no_connection_from_the_sandbox_arrived(escapes):
    mode, report, *_, hits = escapes
    controls_that_connected = sum("CONNECTED" in report[name]["control"]["out"] for name in CONTROLLED)
    assert controls_that_connected >= 5 and hits == controls_that_connected, (hits, controls_that_connected)


def test_audit_mode_is_escapable_so_it_runs_only_when_accepted(listener):
    """Why ``audit`` needs ``data.options.sandbox: unsafe``: native process creation walks past the hook."""
    attack = {"posixsubprocess_fork_exec": ATTACKS["posixsubprocess_fork_exec"]}
    report, home, token = run_attacks("audit", attack, [], {"default": {"wall_s": 20.0}}, port=listener[0])
    subprocess.run(["rm", "-rf", str(home)], check=False)
    out = report["posixsubprocess_fork_exec"]["sandbox"]["out"]
    assert report["posixsubprocess_fork_exec"]["started"]
    assert f"READ:{token}" in out and "CONNECTED" in out and "uid=" in out, out


FLOODS = {
    "fork_count": """
import os, time
forked = 0
for _ in range(30):
    try:
        if os.fork() == 0:
            os.close(1), os.close(2)
            time.sleep(3)
            os._exit(0)
        forked += 1
    except OSError:
        break
print("FORKED", forked, flush=True)
""",
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "memory_flood": "x = bytearray(400 << 20)\nprint('ALLOCATED', len(x), flush=True)",
    "output_flood": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
}
FLOOD_LIMITS = {"default": {"wall_s": 20.0, "cpu_s": 5, "memory_mb": 200},
                "fork_count": {"wall_s": 20.0, "max_processes": 8},
                "fork_bomb": {"wall_s": 3.0, "cpu_s": 2, "max_processes": 16},
                # cpu_s well above wall_s: this attack tests the wall limit and the output cap. With
                # the default 2 s of CPU, an idle machine gives the writer a whole core and RLIMIT_CPU
                # (SIGXCPU) fires before the 3 s wall limit; under load the wall limit fires first.
                "output_flood": {"wall_s": 3.0, "cpu_s": 30, "max_output_bytes": 10000}}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_fork_bomb_memory_and_output_floods_are_contained(mode, listener):
    report, home, _ = run_attacks(mode, FLOODS, ["fork_count", "memory_flood"], FLOOD_LIMITS, port=listener[0])
    subprocess.run(["rm", "-rf", str(home)], check=False)
    assert all(report[name]["started"] for name in FLOODS), report
    assert "FORKED 30" in report["fork_count"]["control"]["out"]  # the user may fork 30 outside
    forked = int(report["fork_count"]["sandbox"]["out"].split()[-1])
    assert 0 < forked < 8, report["fork_count"]  # RLIMIT_NPROC 8, init and the program included
    bomb = report["fork_bomb"]["sandbox"]
    assert bomb["timed_out"], bomb  # stopped by the wall limit, every process of it killed (run_attacks)
    assert "ALLOCATED" in report["memory_flood"]["control"]["out"]
    memory = report["memory_flood"]["sandbox"]
    assert memory["rc"] != 0 and "MemoryError" in memory["err"], memory
    flood = report["output_flood"]["sandbox"]
    assert flood["timed_out"] and flood["out_len"] == 10000, flood
    assert report["sibling_alive"]
