"""Engines that die come back: find dead or hung engines, restart them within a budget, return them
to routing with the current weights, and give up clearly when none is left.

Roles:
- the *launcher* (whoever started the engine process: ``LocalEngines`` on trainer rank 0 for embedded
  engines; the node runner under Slurm, ``launch/node.py``) restarts the process;
- the *supervisor* (trainer rank 0, on the scheduler's event loop) probes every engine, takes a dead
  one out of routing (the client's engine list and, when used, the router's workers), asks the
  launcher to restart it (or, without a local launcher, waits for it to answer again at its
  address), has the current weights loaded (``readmit``) and puts it back.

Detection. An engine is dead when its local process exited (at once), or when ``/model_info`` (served
without the scheduler, answered while paused: ``rollout.health``) does not answer within
``probe_timeout_s`` on ``hang_probes`` checks in a row: a hung (e.g. SIGSTOPped) engine is found within
``hang_probes * (interval_s + probe_timeout_s)`` (21 s by default) and killed by its restart.
``/model_info`` still answers when only SGLang's scheduler or detokenizer is stuck, so liveness is also
judged the way SGLang judges it: ``/health`` (a one-token generation, 503 after SGLang's 20 s bound)
failing on ``hang_probes`` probes in a row while the client had not paused the engine (a paused engine
cannot pass it) is stuck: found within about ``hang_probes * (20 s + interval_s)``, restarted like a
dead one. One /health probe is in flight per engine at a time (``RolloutClient.check_engine``, run
beside the checks so a 20 s answer does not slow them); a passing one also routes an engine the client
had marked unhealthy back in (continued first if a failed continue left it paused).

Budget. ``restart_budget`` restarts per engine per run (a flaky host does not use up the others');
a failed start counts. Past it the engine stays out. With no healthy engine for ``no_engine_timeout_s``,
``wait_no_engine()`` returns a :class:`NoEngineError` for the trainer to checkpoint and stop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import httpx

from sao_megatron.errors import SaoError
from sao_megatron.rollout.health import EngineState, headers_for, probe

logger = logging.getLogger(__name__)

Admit = Callable[[str], Awaitable[None]]
Readmit = Callable[[str, str, Admit], Awaitable[None]]
"""(old_url, new_url, admit) → have the engine at new_url load the current weights and call
``admit(new_url)`` once it serves them: at once, under the lock weight pushes hold (so no push falls
between the load and the admission), or later (a distributed sync admits after its next push)."""


class NoEngineError(SaoError):
    """No rollout engine was healthy for rollout.no_engine_timeout_s: the run checkpointed and stopped."""


class EngineLauncher(Protocol):
    """What the process that started the engines offers (``rollout.launch.LocalEngines``)."""

    def alive(self, index: int) -> bool: ...

    def restart(self, index: int) -> str:
        """Kill engine ``index`` if it still runs, start it again, wait for /health; its URL (blocking)."""
        ...


class RouterWorkers(Protocol):
    """A router's worker list (``rollout.router_admin.RouterAdmin``)."""

    async def remove(self, url: str) -> None: ...

    async def add(self, url: str) -> None: ...


@dataclass(slots=True)
class _Engine:
    index: int
    url: str
    state: str = "ok"
    """ok (routed), down (out of routing, restart pending), restarting, admitting, failed (budget spent)."""
    restarts: int = 0
    silent: int = 0
    """Checks in a row without an answer."""
    stuck: int = 0
    """/health probes in a row that failed while the engine was not paused (scheduler or detokenizer hung)."""
    judging: asyncio.Task | None = None
    """The /health probe in flight (``_liveness``)."""


class EngineSupervisor:
    """Keeps the engines of ``client`` alive; ``run()`` is its loop (start it as a task)."""

    def __init__(self, client, urls: Sequence[str], *, readmit: Readmit, restart_budget: int,
                 no_engine_timeout_s: float, launcher: EngineLauncher | None = None,
                 router: RouterWorkers | None = None, interval_s: float = 2.0, hang_probes: int = 3,
                 probe_timeout_s: float = 5.0, api_key: str | None = None):
        if restart_budget < 0 or no_engine_timeout_s <= 0 or hang_probes < 1:
            raise ValueError("restart_budget must be >= 0, no_engine_timeout_s > 0 and hang_probes >= 1")
        self.client, self.launcher, self.router, self.readmit = client, launcher, router, readmit
        self.engines = [_Engine(i, u.rstrip("/")) for i, u in enumerate(urls)]
        self.restart_budget, self.no_engine_timeout_s = restart_budget, no_engine_timeout_s
        self.interval_s, self.hang_probes, self.probe_timeout_s = interval_s, hang_probes, probe_timeout_s
        self.num_restarts = 0
        self._http = httpx.AsyncClient(trust_env=False, headers=headers_for(api_key))
        self._none_since: float | None = None
        self._no_engine = asyncio.Event()
        self.error: NoEngineError | None = None
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """Check every ``interval_s`` until cancelled."""
        while True:
            try:
                await self.check()
            except Exception:  # noqa: BLE001 - the watchdog must outlive one bad check
                logger.exception("engine supervisor check failed")
            await asyncio.sleep(self.interval_s)

    async def check(self) -> None:
        """One round: probe routed engines, restart the dead ones, watch for an empty engine set."""
        routed = [e for e in self.engines if e.state == "ok"]
        states = await asyncio.gather(*(self._state(e) for e in routed))
        for e, dead in zip(routed, states):
            if dead:
                await self._take_out(e, dead)
        for e in self.engines:
            if e.state == "down":
                e.state = "restarting"  # before the task runs: one bring-back at a time
                self._spawn(self._bring_back(e))
        self._watch_empty()

    async def _state(self, e: _Engine) -> str:
        """'' when alive, else why it counts as dead."""
        if self.launcher is not None and not self.launcher.alive(e.index):
            return "its process exited"
        if await probe(self._http, e.url, paused=True, info_timeout_s=self.probe_timeout_s) is EngineState.DEAD:
            e.silent += 1
        else:
            e.silent = 0
        if e.silent >= self.hang_probes:
            return f"no answer to /model_info on {e.silent} checks in a row (hung)"
        self._judge(e)
        if e.stuck >= self.hang_probes:
            return (f"/health failed on {e.stuck} probes in a row while generation was not paused (SGLang's "
                    "scheduler or detokenizer is stuck)")
        return ""

    def _judge(self, e: _Engine) -> None:
        """Count the verdict of ``e``'s last /health probe if it finished, and start the next one."""
        if e.judging is not None and e.judging.done():  # never cancelled here: _take_out drops it first
            verdict, e.judging = e.judging.result(), None
            if verdict is not None:
                e.stuck = 0 if verdict else e.stuck + 1
        if e.judging is None:
            e.judging = self._spawn(self._liveness(e.url))

    async def _liveness(self, url: str) -> bool | None:
        """True: /health passed; False: it failed on an engine not paused from start to end; None: no
        verdict (paused by the client meanwhile, or no answer at all, which the /model_info checks judge)."""
        pauses = self.client.num_pauses
        try:
            state = await self.client.check_engine(url)
        except Exception:  # noqa: BLE001 - the watchdog must outlive one bad probe
            logger.exception("/health probe of %s failed", url)
            return None
        if state is EngineState.OK:
            return True
        if state is EngineState.STUCK and self.client.num_pauses == pauses:
            return False
        return None

    async def _take_out(self, e: _Engine, why: str) -> None:
        logger.warning("engine %d (%s) is dead: %s; taking it out of routing", e.index, e.url, why)
        self.client.remove_engine(e.url)
        if self.router is not None:
            await self._router_call(self.router.remove, e.url)
        if e.judging is not None:
            e.judging.cancel()
        e.state, e.silent, e.stuck, e.judging = "down", 0, 0, None

    async def _bring_back(self, e: _Engine) -> None:
        if self.launcher is not None and e.restarts >= self.restart_budget:
            logger.error("engine %d stays down: its restart budget (rollout.engine_restart_budget=%d) is spent",
                         e.index, self.restart_budget)
            e.state = "failed"
            return
        old = e.url
        try:
            if self.launcher is not None:
                e.restarts += 1
                new = await asyncio.to_thread(self.launcher.restart, e.index)
            else:  # someone else restarts it (the node runner): wait until it answers at its address
                if await probe(self._http, old, paused=True, info_timeout_s=self.probe_timeout_s) is EngineState.DEAD:
                    e.state = "down"
                    return
                new = old
            e.url, e.state = new.rstrip("/"), "admitting"
            await self.readmit(old, e.url, self.admit)
        except Exception as exc:  # noqa: BLE001 - retried on the next check while budget is left
            logger.error("engine %d could not be brought back: %s", e.index, exc)
            e.state = "down"

    async def admit(self, url: str) -> None:
        """Route to the engine at ``url`` again (it serves the current weights)."""
        e = next(x for x in self.engines if x.url == url.rstrip("/"))
        self.client.add_engine(e.url)
        if self.router is not None:
            await self._router_call(self.router.add, e.url)
        self.num_restarts += 1
        e.state, e.silent = "ok", 0
        logger.warning("engine %d back in service at %s (restarts: %d)", e.index, e.url, e.restarts)

    def pending_admission(self) -> list[str]:
        """URLs of restarted engines not yet admitted (loading weights, or waiting for the next push)."""
        return [e.url for e in self.engines if e.state == "admitting"]

    async def _router_call(self, fn, url: str) -> None:
        try:
            await fn(url)
        except Exception as exc:  # noqa: BLE001 - the client's own list still keeps control calls right
            logger.error("router update for %s failed: %s", url, exc)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------------ no engine left
    def _watch_empty(self) -> None:
        if self.client.healthy_urls():
            self._none_since = None
            return
        now = time.monotonic()
        self._none_since = self._none_since or now
        if now - self._none_since >= self.no_engine_timeout_s and self.error is None:
            states = ", ".join(f"{e.url}: {e.state} after {e.restarts} restarts" for e in self.engines)
            self.error = NoEngineError(
                f"no rollout engine was healthy for {self.no_engine_timeout_s:.0f} s ({states}). The run "
                "checkpointed and stopped: check the engine logs (run_dir/logs) for why they die, then resume "
                "with --resume auto; raise rollout.engine_restart_budget or rollout.no_engine_timeout_s if "
                "the engines only need more restarts or more time to load")
            self._no_engine.set()

    async def wait_no_engine(self) -> NoEngineError:
        """Returns once no engine has been healthy for ``no_engine_timeout_s``."""
        await self._no_engine.wait()
        assert self.error is not None
        return self.error

    # ------------------------------------------------------------------ metrics, shutdown
    def metrics(self) -> dict[str, float]:
        return {"rollout/engines_healthy": float(len(self.client.healthy_urls())),
                "rollout/engine_restarts": float(self.num_restarts)}

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._http.aclose()
