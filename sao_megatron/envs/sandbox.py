"""Run untrusted Python (model-written code, tool calls) in an isolated subprocess.

``run_python(code, files=..., limits=...)`` writes ``code`` as ``main.py`` (plus the task's files)
into a fresh temporary directory and runs it through ``_sandbox_boot.py``, which isolates the
process before exec'ing the interpreter (details in that module):

- ``namespace`` (root): mount, network, PID, IPC and UTS namespaces; a tmpfs root with only the
  read-only interpreter and system libraries plus the working directory; ``nobody``; no-new-privs.
- ``userns`` (no privileges needed): the same inside an unprivileged user namespace that maps only
  the caller's own uid. This is the mode of a trainer that does not run as root.
- ``audit`` (no isolation): rlimits plus a Python audit hook. It stops ordinary code, not native
  code (``_posixsubprocess.fork_exec``, ``ctypes``), so it runs only when asked for explicitly.

``isolation="auto"`` takes the first isolating mode that works here (``namespace``, then
``userns``) and raises ``SandboxUnavailableError`` when none does; ``resolve_isolation(policy)``
is the start-up check behind ``data.options.sandbox: isolated | unsafe``.

Limits: CPU seconds, address space and processes via ``setrlimit``, wall time enforced here by
killing the process group (the namespace dies with its init), stdout/stderr truncated to
``max_output_bytes``.
"""

from __future__ import annotations

import functools
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

from sao_megatron.errors import SaoError

logger = logging.getLogger(__name__)

_BOOT = pathlib.Path(__file__).with_name("_sandbox_boot.py")
_NOBODY = 65534
IsolationMode = Literal["auto", "namespace", "userns", "audit"]
ISOLATING_MODES = ("namespace", "userns")
SANDBOX_POLICIES = ("isolated", "unsafe")
_DESCRIPTION = {
    "namespace": "namespace isolation (root: mount+network+PID namespaces, chroot, uid nobody)",
    "userns": "unprivileged user-namespace isolation (user+mount+network+PID namespaces, chroot)",
    "audit": "NO isolation (audit hook only): model-written code can read this user's files, "
             "run programs and use the network",
}


class SandboxUnavailableError(SaoError):
    """No isolating sandbox mode works on this machine and the unsafe fallback was not accepted."""


@dataclass(kw_only=True, slots=True)
class SandboxLimits:
    """Resource limits of one sandboxed run."""

    cpu_s: float = 2.0
    """CPU-time limit (RLIMIT_CPU, whole seconds, at least 1)."""
    wall_s: float = 5.0
    """Wall-clock limit; the process group is killed after it."""
    memory_mb: int = 512
    """Address-space limit (RLIMIT_AS) of each process."""
    max_output_bytes: int = 65536
    """stdout and stderr are each truncated to this many bytes."""
    max_processes: int = 64
    """Process limit (RLIMIT_NPROC) of the isolated uid/user namespace; not applied in audit mode."""


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
    """True when root namespace isolation works here (root with CAP_SYS_ADMIN)."""
    return hasattr(os, "unshare") and os.geteuid() == 0 and _mode_works("namespace")


def describe_isolation(mode: str) -> str:
    """One line saying what ``mode`` protects against (for the start-up log)."""
    return _DESCRIPTION[mode]


def resolve_isolation(policy: str = "isolated") -> str:
    """The mode to run model-written code in under ``policy`` (``isolated`` or ``unsafe``).

    ``isolated``: the best isolating mode, else ``SandboxUnavailableError`` saying how to fix it.
    ``unsafe``: the same, but falls back to ``audit`` (no isolation) where none works.
    """
    if policy not in SANDBOX_POLICIES:
        raise ValueError(f"sandbox policy {policy!r} must be one of {list(SANDBOX_POLICIES)}")
    for mode in ISOLATING_MODES:
        if (mode == "userns" or os.geteuid() == 0) and _mode_works(mode):
            return mode
    if policy == "unsafe":
        return "audit"
    raise SandboxUnavailableError(
        "no isolating sandbox works on this machine: neither root namespaces nor unprivileged user "
        "namespaces (check `unshare --user --map-root-user --net true`; enable with sysctl "
        "user.max_user_namespaces>0, kernel.unprivileged_userns_clone=1 on Debian or "
        "kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu). Refusing to run model-written code "
        "unisolated; set data.options.sandbox=unsafe to accept the audit-hook fallback, which native "
        "code escapes")


def sandbox_mode(policy: str, *, what: str) -> str:
    """``data.options.sandbox`` -> the mode model-written code runs in, probed once and logged in one
    line (a warning for the unisolated audit mode). ``what`` names the task in the log line."""
    if policy not in SANDBOX_POLICIES:
        raise ValueError(f"data.options.sandbox={policy!r} must be 'isolated' (model-written code runs only "
                         "in an isolating sandbox; the default) or 'unsafe' (also accept the audit-hook "
                         "fallback, which native code escapes, where no isolation works)")
    mode = resolve_isolation(policy)
    (logger.warning if mode == "audit" else logger.info)(
        "%s sandbox (data.options.sandbox=%s): %s", what, policy, describe_isolation(mode))
    return mode


@functools.cache
def _mode_works(mode: str) -> bool:
    """Probe ``mode`` once per process by running a trivial program in it."""
    try:
        res = run_python("print('sandbox-ok')", isolation=mode, limits=SandboxLimits(wall_s=60.0))
    except OSError:
        return False
    if not (res.ok and res.stdout.strip() == "sandbox-ok"):
        logger.debug("sandbox mode %s does not work here: %s", mode, res.stderr.strip()[-500:])
        return False
    return True


def run_python(code: str, *, files: dict[str, str | bytes] | None = None, stdin: str = "",
               limits: SandboxLimits | None = None, isolation: IsolationMode = "auto",
               collect: tuple[str, ...] = ()) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a sandbox; ``files`` are provided next to it (relative paths).

    ``collect`` names files to read back from the working directory after the run.
    ``isolation="auto"`` raises ``SandboxUnavailableError`` where no isolating mode works.
    """
    limits = limits or SandboxLimits()
    mode = resolve_isolation("isolated") if isolation == "auto" else isolation
    if mode not in (*ISOLATING_MODES, "audit"):
        raise ValueError(f"sandbox isolation {isolation!r} must be 'auto', 'namespace', 'userns' or 'audit'")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="sao-sandbox-"))
    try:
        work = _prepare_workdir(tmp, code, files or {}, chown=mode == "namespace")
        root = tmp / "root"
        root.mkdir()
        spec = {"mode": mode, "work": str(work), "root": str(root), "exe": os.path.realpath(sys.executable),
                "prefix": os.path.realpath(sys.base_prefix), "cpu_s": max(1, int(limits.cpu_s)),
                "memory_mb": limits.memory_mb, "max_processes": limits.max_processes}
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
