"""Rewards off the event loop, contained, and the non-stationary reward schedule.

``RewardPool`` runs reward functions in worker processes (forkserver: never forks a trainer with
torch threads). A function that raises, returns a non-finite value, exceeds the time limit or
kills its worker yields reward 0 with the reason logged and in ``RewardOutcome.error``; a stuck
or dead worker is killed and replaced, so the run goes on.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import functools
import logging
import math
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from sao_megatron.config.schema import RewardPhase
from sao_megatron.parallel.launcher_env import is_launcher_variable

logger = logging.getLogger(__name__)
# The modules holding the task reward functions: the fork server preloads them so each worker forks
# with them imported (the envs package itself imports this module, so it is not named here).
REWARD_MODULES = tuple(f"sao_megatron.envs.{m}" for m in ("arithmetic", "code_task", "math_task", "tool_chain", "tools"))
_START_TIMEOUT_S = 120.0


@dataclass(slots=True)
class RewardOutcome:
    """Result of one reward call."""

    reward: float
    """The reward (0.0 on error)."""
    info: dict[str, float] = field(default_factory=dict)
    """Reward components returned by the function."""
    error: str | None = None
    """Why the reward is 0 when the call failed: 'timeout', 'exception: ...', 'worker died', ..."""
    elapsed_s: float = 0.0
    """Wall time of the call."""


def _worker_main(conn) -> None:
    # A worker is no rank of the trainer's world: the launcher's variables it inherited through the
    # fork server go (multiprocessing passes no environment of its own to a child).
    for name in [k for k in os.environ if is_launcher_variable(k)]:
        del os.environ[name]
    # The task reward functions' modules, imported before timing starts (not the envs package, which
    # imports this module).
    from sao_megatron.envs import arithmetic, code_task, math_task, tool_chain, tools  # noqa: F401
    conn.send(("ready", None))
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - everything is reported, nothing escapes
            tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
            conn.send(("err", tb))


class _Worker:
    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        # Start-up (interpreter + imports) must not count against the first reward's time limit.
        if not self.conn.poll(_START_TIMEOUT_S) or self.conn.recv()[0] != "ready":
            self.kill()
            raise RuntimeError(f"reward worker did not start within {_START_TIMEOUT_S} s")

    def call(self, fn: Callable, args: tuple, timeout_s: float) -> tuple[str, object]:
        self.conn.send((fn, args))
        if not self.conn.poll(timeout_s):
            return "timeout", None
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return "died", None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def _retire(original: _Worker | None, cfut: concurrent.futures.Future) -> None:
    worker = original if cfut.cancelled() or cfut.exception() else cfut.result()[2]
    if worker is not None:
        worker.kill()


def _preload_forkserver(ctx) -> None:
    """Import the reward modules once in the fork server, so each forked worker starts with them.

    Without it every worker (the first ones and each replacement of a killed one) re-imported the
    config and the tasks: ~2 s each on a quiet machine. Effective only before the process's fork
    server starts (it is shared by the whole process); ``__main__`` stays preloaded as by default.
    """
    ctx.set_forkserver_preload(["__main__", *REWARD_MODULES, __name__])


class RewardPool:
    """``num_workers`` reward processes; ``await score(fn, *args)`` never raises for a bad reward."""

    def __init__(self, num_workers: int, timeout_s: float, *, start_method: str = "forkserver") -> None:
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError("data.reward_workers must be >= 1 and data.reward_timeout_s > 0")
        self.timeout_s = timeout_s
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            _preload_forkserver(self._ctx)
        self._idle: list[_Worker | None] = [None] * num_workers  # started lazily
        self._slots = asyncio.Semaphore(num_workers)
        self._threads = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="reward")
        self.num_errors = 0

    async def score(self, fn: Callable, *args) -> RewardOutcome:
        async with self._slots:
            worker = self._idle.pop()
            t0 = time.monotonic()
            cfut = self._threads.submit(self._call, worker, fn, args)
            try:
                status, value, worker = await asyncio.wrap_future(cfut)
            except BaseException:
                # Cancelled mid-call: the thread still owns the worker; retire it when the call ends.
                cfut.add_done_callback(functools.partial(_retire, worker))
                worker = None
                raise
            finally:
                self._idle.append(worker)
            return self._outcome(fn, status, value, time.monotonic() - t0)

    def _call(self, worker: _Worker | None, fn: Callable, args: tuple) -> tuple[str, object, _Worker | None]:
        """Runs on a pool thread: (status, value, the worker to reuse or None)."""
        if worker is None or not worker.proc.is_alive():
            try:
                worker = _Worker(self._ctx)
            except Exception as exc:  # noqa: BLE001 - reported as this sample's reward error
                return "err", f"reward worker failed to start: {exc!r}", None
        try:
            status, value = worker.call(fn, args, self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable function: nothing was sent
            return "err", f"cannot send the call to a reward worker: {exc!r}", worker
        if status in ("timeout", "died"):
            worker.kill()
            worker = None
        return status, value, worker

    def _outcome(self, fn: Callable, status: str, result: object, elapsed: float) -> RewardOutcome:
        name = getattr(fn, "__name__", repr(fn))
        if status == "ok":
            reward, info = result if isinstance(result, tuple) and len(result) == 2 else (result, {})
            if isinstance(reward, (int, float)) and math.isfinite(reward) and isinstance(info, dict):
                return RewardOutcome(float(reward), dict(info), None, elapsed)
            status, result = "err", f"reward must be a finite number or (number, dict), got {result!r:.80}"
        error = {"timeout": f"timeout after {self.timeout_s:g} s", "died": "reward worker died"}.get(
            status, f"exception: {result}")
        self.num_errors += 1
        logger.warning("reward %s -> 0 (%s)", name, error)
        return RewardOutcome(0.0, {}, error, elapsed)

    async def start(self) -> None:
        """Start every worker now (otherwise on first use)."""
        loop = asyncio.get_running_loop()
        new = await asyncio.gather(*(loop.run_in_executor(self._threads, _Worker, self._ctx)
                                     for w in self._idle if w is None))
        self._idle = [w for w in self._idle if w is not None] + list(new)

    def close(self) -> None:
        for w in self._idle:
            if w is not None:
                w.kill()
        self._idle = [None] * len(self._idle)
        self._threads.shutdown(wait=False, cancel_futures=True)


class RewardSchedule:
    """Phases of a non-stationary reward: ``target_at(v)`` is the target in force at trainer version v."""

    def __init__(self, phases: list[RewardPhase], *, check: Callable[[str], None] | None = None) -> None:
        phases = sorted(phases, key=lambda p: p.start_version) or [RewardPhase(start_version=0, target="")]
        if phases[0].start_version != 0:
            phases.insert(0, RewardPhase(start_version=0, target=""))
        starts = [p.start_version for p in phases]
        if len(set(starts)) != len(starts):
            raise ValueError(f"data.phases: two phases start at the same version ({starts})")
        for p in phases:
            if check:
                check(p.target)
        self.phases = phases
        self._starts = starts

    def phase_at(self, version: int) -> int:
        """Index of the phase in force at ``version``."""
        return bisect.bisect_right(self._starts, version) - 1

    def target_at(self, version: int) -> str:
        return self.phases[self.phase_at(version)].target
