"""Run untrusted Python (model-written code, tool calls) in an isolated subprocess.

``run_python(code, files=..., limits=...)`` writes ``code`` as ``main.py`` (plus the task's files)
into a fresh temporary directory and runs it through ``_sandbox_boot.py``, which isolates the
process before exec'ing the interpreter (see that module for the two isolation levels):

- ``namespace``: chosen when running as root (here and in CI) — network and mount namespaces, a
  tmpfs root with only the read-only interpreter and system libraries plus the working directory,
  ``nobody`` uid, no-new-privs.
- ``audit``: the fallback without privileges — rlimits plus an audit hook refusing sockets, files
  outside the working directory/stdlib and process creation (stops ordinary code, not ctypes).

Limits: CPU seconds and address space via ``setrlimit``, wall time enforced here by killing the
whole process group, stdout/stderr truncated to ``max_output_bytes``.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Literal

logger = logging.getLogger(__name__)

_BOOT = pathlib.Path(__file__).with_name("_sandbox_boot.py")
_NOBODY = 65534
IsolationMode = Literal["auto", "namespace", "audit"]


@dataclass(kw_only=True, slots=True)
class SandboxLimits:
    """Resource limits of one sandboxed run."""

    cpu_s: float = 2.0
    """CPU-time limit (RLIMIT_CPU, whole seconds, at least 1)."""
    wall_s: float = 5.0
    """Wall-clock limit; the process group is killed after it."""
    memory_mb: int = 512
    """Address-space limit (RLIMIT_AS)."""
    max_output_bytes: int = 65536
    """stdout and stderr are each truncated to this many bytes."""


@dataclass(slots=True)
class SandboxResult:
    """What a sandboxed run produced."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    isolation: str
    files: dict[str, bytes] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def namespace_available() -> bool:
    """True when the process may create namespaces and chroot (root with CAP_SYS_ADMIN)."""
    return hasattr(os, "unshare") and os.geteuid() == 0


def run_python(code: str, *, files: dict[str, str | bytes] | None = None, stdin: str = "",
               limits: SandboxLimits | None = None, isolation: IsolationMode = "auto",
               collect: tuple[str, ...] = ()) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a sandbox; ``files`` are provided next to it (relative paths).

    ``collect`` names files to read back from the working directory after the run.
    """
    limits = limits or SandboxLimits()
    mode = ("namespace" if namespace_available() else "audit") if isolation == "auto" else isolation
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="sao-sandbox-"))
    try:
        work = _prepare_workdir(tmp, code, files or {}, chown=mode == "namespace")
        root = tmp / "root"
        root.mkdir()
        spec = {"mode": mode, "work": str(work), "root": str(root), "exe": os.path.realpath(sys.executable),
                "prefix": os.path.realpath(sys.base_prefix), "cpu_s": max(1, int(limits.cpu_s)),
                "memory_mb": limits.memory_mb}
        result = _spawn(spec, stdin, limits, mode)
        result.files = {name: (work / name).read_bytes() for name in collect if (work / name).is_file()}
        return result
    finally:
        _cleanup(tmp)


def _prepare_workdir(tmp: pathlib.Path, code: str, files: dict[str, str | bytes], *, chown: bool) -> pathlib.Path:
    work = tmp / "work"
    work.mkdir()
    for name, content in {**files, "main.py": code}.items():
        path = (work / name).resolve()
        if not path.is_relative_to(work.resolve()):
            raise ValueError(f"sandbox file name {name!r} escapes the working directory; use a relative path")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    if chown:  # the code runs as nobody and may write only here
        for p in [work, *work.rglob("*")]:
            os.chown(p, _NOBODY, _NOBODY)
    return work


def _spawn(spec: dict, stdin: str, limits: SandboxLimits, mode: str) -> SandboxResult:
    cmd = [os.path.realpath(sys.executable), "-I", "-S", str(_BOOT), json.dumps(spec)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env={"PATH": "/usr/bin:/bin"})
    cap = limits.max_output_bytes
    # Readers keep the first `cap` bytes and drain the rest: an output flood costs no memory here.
    out, err = bytearray(), bytearray()
    threads = [threading.Thread(target=_drain, args=(pipe, buf, cap), daemon=True)
               for pipe, buf in ((proc.stdout, out), (proc.stderr, err))]
    threads.append(threading.Thread(target=_feed, args=(proc.stdin, stdin.encode()), daemon=True))
    for t in threads:
        t.start()
    timed_out = False
    try:
        proc.wait(timeout=limits.wall_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid)
        proc.wait()
    for t in threads:
        t.join(timeout=5.0)  # a process that left the group may hold the pipes; do not wait on it
    return SandboxResult(returncode=proc.returncode, stdout=bytes(out).decode(errors="replace"),
                         stderr=bytes(err).decode(errors="replace"), timed_out=timed_out, isolation=mode)


def _drain(pipe, buf: bytearray, cap: int) -> None:
    with pipe:
        while chunk := pipe.read1(1 << 16):
            if len(buf) < cap:
                buf += chunk[:cap - len(buf)]


def _feed(pipe, data: bytes) -> None:
    try:
        with pipe:
            pipe.write(data)
    except (BrokenPipeError, OSError):  # the program exited without reading its input
        pass


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _cleanup(tmp: pathlib.Path) -> None:
    # The binds live only in the child's mount namespace; still, never recurse into a mount point.
    root = tmp / "root"
    if root.exists():
        if os.path.ismount(root):
            logger.error("sandbox root %s is still mounted; leaving it in place", root)
            return
        os.rmdir(root)
    shutil.rmtree(tmp, ignore_errors=True)
