"""Run the Megatron check scripts in subprocesses (one process, or several ranks as torchrun starts them).

Megatron code never runs inside the pytest process: the CPU shims patch torch.cuda and enter a
global device mode, which must not leak into other tests. The subprocesses fork from one server
per pytest session that imported torch, Megatron and the package once (preload_server.py): each
still starts from a fresh state and ends with its changes, but no longer pays ~6 CPU-seconds of
imports per process (per rank: a 4-rank torchrun launch paid that five times). Where a CUDA GPU
is visible they stay plain processes (torchrun for ranks), as the GPU tests were written for.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import tempfile
import time

SCRIPTS = pathlib.Path(__file__).resolve().parent / "mp_scripts"
SERVER = pathlib.Path(__file__).resolve().parent / "preload_server.py"
START_TIMEOUT_S = 900.0
"""The server's imports: ~10 s on an idle 2-core box, minutes under heavy load."""


def run(script: str, *args: str, nproc: int | None = None, timeout: float = 600.0, check: bool = True,
        light_main: bool = False) -> subprocess.CompletedProcess:
    """``python SCRIPT args`` or, with ``nproc``, what ``torchrun --standalone --nproc_per_node=N SCRIPT args``
    starts (torchrun's rank variables, the others ended when one rank fails); output captured.

    ``light_main``: through mp_scripts/light_main.py, for scripts that save Megatron checkpoints (see there).
    """
    argv = [str(SCRIPTS / "light_main.py"), pathlib.Path(script).stem] if light_main else [str(SCRIPTS / script)]
    return launch([*argv, *args], nproc=nproc, timeout=timeout, check=check)


def launch(argv: list[str], *, module: bool = False, nproc: int | None = None, cwd: str | os.PathLike | None = None,
           timeout: float = 600.0, check: bool = True) -> subprocess.CompletedProcess:
    """``python ARGV...`` (``python -m ARGV...`` with ``module``) forked from the preloaded server."""
    argv = [str(a) for a in argv]
    cwd = str(cwd or os.getcwd())
    if _has_gpu():  # as before the server: a CUDA process must not fork from one that may have touched CUDA
        proc = _plain(argv, module=module, nproc=nproc, cwd=cwd, timeout=timeout)
    else:
        proc = _server().launch(argv, module=module, nproc=nproc, cwd=cwd, env=_env(), timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv[:1] + argv[1:4])} failed (rc={proc.returncode}):\n{tail(proc)}")
    return proc


def tail(proc: subprocess.CompletedProcess, lines: int = 60) -> str:
    """The interesting end of a run's output (progress lines and tracebacks, not Megatron's warnings)."""
    text = (proc.stdout or "") + (proc.stderr or "")
    keep = [ln for ln in text.splitlines() if "warn" not in ln.lower() and ln.strip()]
    return "\n".join(keep[-lines:])


def run_json(script: str, tmp: pathlib.Path, *args: str, nproc: int | None = None, timeout: float = 600.0,
             light_main: bool = False) -> dict:
    """Run a check script that writes RESULTS.json (first argument) using WORKDIR (second)."""
    out = tmp / "results.json"
    run(script, str(out), str(tmp), *args, nproc=nproc, timeout=timeout, light_main=light_main)
    return json.loads(out.read_text())


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _plain(argv: list[str], *, module: bool, nproc: int | None, cwd: str, timeout: float):
    """``python [-m] ARGV`` or ``torchrun --standalone --nproc_per_node=N [-m] ARGV`` (the GPU path)."""
    launcher = [sys.executable] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return subprocess.run([*launcher, *(["-m"] if module else []), *argv], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=cwd)


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def _imports_env(env: dict[str, str]) -> dict[str, str]:
    """The environment the server's imports saw; pytest changes PYTEST_CURRENT_TEST for every test."""
    return {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _read(path: str) -> str:
    try:
        return pathlib.Path(path).read_text(errors="replace")
    except FileNotFoundError:  # the process never wrote to it
        return ""


class PreloadServer:
    """Client of preload_server.py: one launch at a time, each in its own process group."""

    def __init__(self, env: dict[str, str]):
        self.env = env
        self.log = tempfile.NamedTemporaryFile("w+", prefix="preload-server-", suffix=".log")
        self.proc = subprocess.Popen([sys.executable, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env, start_new_session=True)
        self._buf = b""
        try:
            self._reply(time.monotonic() + START_TIMEOUT_S, "ready")
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise
        atexit.register(self.close)

    def launch(self, argv: list[str], *, module: bool, nproc: int | None, cwd: str, env: dict[str, str],
               timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="launch-") as tmp:
            out, err = f"{tmp}/stdout", f"{tmp}/stderr"
            req = {"argv": argv, "module": module, "nproc": nproc, "env": env, "cwd": cwd, "stdout": out, "stderr": err}
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            pid = self._reply(time.monotonic() + 60, "pid")
            try:
                rc = self._reply(time.monotonic() + timeout, "rc")
            except TimeoutError:
                try:
                    os.killpg(pid, signal.SIGKILL)  # the leader's group: every rank and what they started
                except ProcessLookupError:  # the leader ended meanwhile, or had not made its group yet
                    _kill(pid)
                self._reply(time.monotonic() + 60, "rc")
                raise subprocess.TimeoutExpired(argv, timeout, output=_read(out), stderr=_read(err)) from None
            return subprocess.CompletedProcess(argv, rc, _read(out), _read(err))

    def _reply(self, deadline: float, key: str):
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"preload server: no {key!r} reply in time")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            chunk = os.read(self.proc.stdout.fileno(), 65536) if ready else None
            if chunk == b"":
                self.log.seek(0)
                raise RuntimeError(f"preload server exited (rc={self.proc.wait()}):\n{self.log.read()[-4000:]}")
            self._buf += chunk or b""
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)[key]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the server exits at the end of its input
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


_SERVER: list[PreloadServer] = []


def _server() -> PreloadServer:
    """The session's server, (re)started on first use, after it died, or when the environment changed."""
    env = _env()
    if _SERVER and (_SERVER[0].proc.poll() is not None or _imports_env(_SERVER[0].env) != _imports_env(env)):
        _SERVER.pop().close()
    if not _SERVER:
        _SERVER.append(PreloadServer(env))
    return _SERVER[0]
