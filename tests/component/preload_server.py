"""A Python that has imported torch, Megatron and the package once; every check script forks from it.

    python preload_server.py        (started by megatron_launch.py; one per pytest session)

Each launch used to pay for those imports in every process (about 6 CPU-seconds each; a 4-rank
torchrun launch paid five times). Forking keeps what separate processes gave the tests: every
script starts from the state right after the imports (no CPU shim applied, no process group, no
device mode), and whatever it changes dies with it. Only the imports are shared.

Protocol, one JSON object per line: requests on stdin, replies on the inherited fd 1.
Request: {"argv": [...], "module": bool, "nproc": int|null, "env": {...}, "cwd": str,
"stdout": path, "stderr": path}. The server forks a leader in a new process group (the client
kills that group on a timeout) and answers {"pid": leader} at once, then {"rc": code} when the
leader exits. With ``nproc`` the leader forks that many ranks with torchrun's variables (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and, as torchrun does, ends
the others once one rank fails. The server exits when stdin closes (pytest ended).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback

# What the check scripts import (mp_scripts/, convert_scripts/, the CLI's verbs; not sao_megatron.cli
# itself, which ``-m`` runs as __main__): an import error here shows in the server's log.
PRELOAD = [
    "torch", "torch.distributed", "safetensors.torch", "transformers", "megatron.core",
    "megatron.core.dist_checkpointing", "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.pipeline_parallel",
    "sao_megatron.parallel.bootstrap", "sao_megatron.training.verbs.cli", "sao_megatron.training.verbs.smoke_cli",
    "sao_megatron.training.verbs.parity", "checkpoints_tools.hf_to_mcore",
    "checkpoints_tools.mcore_to_hf", "checkpoints_tools.parity", "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.glm4_moe.modeling_glm4_moe", "transformers.models.deepseek_v3.modeling_deepseek_v3", "sao_megatron.models.builder",
    "sao_megatron.models.actor", "sao_megatron.models.critic", "sao_megatron.training.step.optim",
    "sao_megatron.training.step.forward", "sao_megatron.training.run.checkpoint",
    "sao_megatron.training.run.components", "sao_megatron.weights.export",
]
GRACE_S = 5.0
"""After one rank fails: how long the others get after SIGTERM before SIGKILL."""


def preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import torch

    # Children must be able to start CUDA themselves; a parent that initialised it forbids that.
    assert not torch.cuda.is_initialized(), "preloading initialised CUDA: forking would break the children"
    # Forking is safe only from a single-threaded process (no lock can be held by a thread that is gone).
    assert len(os.listdir("/proc/self/task")) == 1, "preloading started threads (OMP_NUM_THREADS=1?): forking is unsafe"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_here(req: dict, env: dict) -> None:
    """Become ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) in this process; never returns."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(req["cwd"])
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    target, *args = req["argv"]
    sys.argv = [target, *args]
    code = 0
    try:
        if req["module"]:
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:  # as the interpreter maps sys.exit's argument to an exit status
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    finish(code)


def finish(code: int) -> None:
    """Interpreter shutdown as ``python`` does it (threads, then atexit, then flush), then exit."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads, as Py_Finalize
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def lead(req: dict) -> None:
    """The leader: one process, or ``nproc`` ranks ended together as torchrun ends them; never returns."""
    os.setpgid(0, 0)
    env = dict(req["env"])
    if req["nproc"] is None:
        run_here(req, env)
    n, port = req["nproc"], free_port()
    ranks = {}
    for rank in range(n):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                        GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        pid = os.fork()
        if pid == 0:
            run_here(req, rank_env)
        ranks[pid] = rank
    os._exit(wait_ranks(ranks))


def wait_ranks(ranks: dict[int, int]) -> int:
    """Wait for every rank; the first failure ends the rest (SIGTERM, then SIGKILL) and is the exit code."""
    failed, deadline = 0, None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG) if deadline else os.waitpid(-1, 0)
        if pid == 0:
            if time.monotonic() > deadline:
                for p in ranks:
                    os.kill(p, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.05)
            continue
        if pid not in ranks:
            continue  # a grandchild re-parented to us (we are no subreaper): not a rank
        del ranks[pid]
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = code if code > 0 else 128 - code
            for p in ranks:
                os.kill(p, signal.SIGTERM)
            deadline = time.monotonic() + GRACE_S
    return failed


def serve() -> None:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints go to stderr, never into the replies
    preload()
    replies.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            try:
                lead(req)
            finally:
                os._exit(70)
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    serve()
