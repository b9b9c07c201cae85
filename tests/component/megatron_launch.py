"""Run the Megatron check scripts in subprocesses (one process, or torchrun with several).

Megatron code never runs inside the pytest process: the CPU shims patch torch.cuda and
enter a global device mode, which must not leak into other tests.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

SCRIPTS = pathlib.Path(__file__).resolve().parent / "mp_scripts"


def run(script: str, *args: str, nproc: int | None = None, timeout: float = 600.0,
        check: bool = True) -> subprocess.CompletedProcess:
    """``python SCRIPT args`` or ``torchrun --standalone --nproc_per_node=N SCRIPT args``; output captured."""
    launcher = [sys.executable] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([*launcher, str(SCRIPTS / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} failed (rc={proc.returncode}):\n{tail(proc)}")
    return proc


def tail(proc: subprocess.CompletedProcess, lines: int = 60) -> str:
    """The interesting end of a run's output (progress lines and tracebacks, not Megatron's warnings)."""
    text = (proc.stdout or "") + (proc.stderr or "")
    keep = [ln for ln in text.splitlines() if "warn" not in ln.lower() and ln.strip()]
    return "\n".join(keep[-lines:])


def run_json(script: str, tmp: pathlib.Path, *args: str, nproc: int | None = None,
             timeout: float = 600.0) -> dict:
    """Run a check script that writes RESULTS.json (first argument) using WORKDIR (second)."""
    out = tmp / "results.json"
    run(script, str(out), str(tmp), *args, nproc=nproc, timeout=timeout)
    return json.loads(out.read_text())
