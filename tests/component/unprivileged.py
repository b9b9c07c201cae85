"""Run a Python script as a non-root user, under outer limits, for the sandbox tests.

A trainer on a cluster is not root, so the sandbox tests run the attacks as a fresh uid that owns
nothing on the machine (no passwd entry needed). As root: ``unshare --mount`` gives the script a
private mount namespace in which root-only directories on the way to the interpreter and the venv
(``/root`` here) are replaced by a world-traversable view of just those entries, then
``setpriv`` drops to the uid. Run by a non-root user, the script runs as that user. Either way the
script runs under ``prlimit`` (processes, address space, no core files) and ``timeout -s KILL``,
so a sandbox that fails to contain a fork bomb or a memory flood cannot take the machine down.
"""

from __future__ import annotations

import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[2]
TEST_UID = 40000 + os.getpid() % 20000 if os.geteuid() == 0 else os.getuid()
"""The uid the scripts run as: a fresh one per pytest process when run as root."""


def _blocked_entries(paths: list[str]) -> dict[str, set[str]]:
    """{directory others may not traverse: {its entries on the way to ``paths``}}."""
    blocked: dict[str, set[str]] = {}
    for path in paths:
        parts = pathlib.Path(path).resolve().parts
        for depth in range(1, len(parts)):  # every directory on the way, the path's own parent too
            parent = os.path.join(*parts[:depth])
            if not os.stat(parent).st_mode & 0o001:
                blocked.setdefault(parent, set()).add(parts[depth])
                break
    return blocked


def _rig(view: str) -> str:
    """Shell that re-exposes the blocked directories' needed entries through ``view``."""
    lines = ["set -e"]
    # The checkout's own entries: a clone in a private directory (``mktemp -d`` makes it 0700) is
    # re-exposed like /root is.
    needed = [sys.base_prefix, sys.prefix, os.path.realpath(sys.executable), *map(str, REPO.iterdir())]
    for k, (parent, entries) in enumerate(sorted(_blocked_entries(needed).items())):
        top = f"{view}/{k}"
        lines.append(f"mkdir -m 755 {top}")
        for entry in sorted(entries):
            path = os.path.join(parent, entry)
            src, dst = shlex.quote(path), shlex.quote(f"{top}/{entry}")
            lines += [f"mkdir {dst}" if os.path.isdir(path) else f": > {dst}", f"mount --rbind {src} {dst}"]
        lines.append(f"mount --rbind {top} {shlex.quote(parent)}")
    return "\n".join(lines)


def make_user_dir() -> pathlib.Path:
    """A fresh directory under /tmp owned by the test uid and private to it (mode 700)."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="sao-sandbox-test-"))
    os.chown(path, TEST_UID, TEST_UID)
    return path


def run_unprivileged(script: str, *, timeout_s: float = 120.0, max_processes: int = 256,
                     memory_mb: int = 4096) -> subprocess.CompletedProcess:
    """Run ``python -c script`` as ``TEST_UID`` (PYTHONPATH = the repo) under the outer limits."""
    limits = ["prlimit", f"--nproc={max_processes}", f"--as={memory_mb << 20}", "--core=0", "--",
              "timeout", "-s", "KILL", str(int(timeout_s)), sys.executable, "-c", script]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": "/nonexistent", "LANG": "C.UTF-8"}
    if os.geteuid() != 0:
        return subprocess.run(limits, capture_output=True, text=True, env=env, timeout=timeout_s + 30)
    view = tempfile.mkdtemp(prefix="sao-sandbox-view-")
    os.chmod(view, 0o755)
    drop = ["setpriv", f"--reuid={TEST_UID}", f"--regid={TEST_UID}", "--clear-groups", "--"]
    shell = _rig(view) + "\nexec " + shlex.join(drop + limits)
    try:
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", shell],
                              capture_output=True, text=True, env=env, timeout=timeout_s + 30, cwd="/tmp")
    finally:
        shutil.rmtree(view, ignore_errors=True)  # the mounts lived only in the script's namespace


def processes_of(uid: int) -> list[int]:
    """PIDs of the live processes whose real uid is ``uid`` (from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = pathlib.Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid and fields["State"].split()[0] != "Z":
            pids.append(int(entry))
    return pids
