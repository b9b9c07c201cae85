"""Asynchronous single-rollout scheduler (docs/architecture.md#staleness): admission under a staleness limit, a FIFO
of finished samples, partial rollouts across weight updates, exactly-once resume.

Definitions (B = ``sched_cfg.batch_size``, η = ``max_staleness``, v = trainer version):

- ``num_started``: episodes admitted whose sample may still be trained on, i.e. trained + waiting
  in the FIFO (or in an incomplete group) + in flight. An episode leaves the count when its sample
  is dropped as stale, discarded by a weight update, fails, or is re-queued at a checkpoint.
- Admission (modes single/group): a unit (1 episode, or G for a group) starts only if after
  starting it ``num_started ≤ (v + η + 1)·B``, and at most ``concurrency`` episodes are in flight.
  ``reset_admission_budget()`` rebases both counts (value pretraining consumes batches without a
  new version).
- Consumption: ``next_batch`` pops FIFO units in order; a unit with any action token of version
  ``< v − η`` is dropped (never trained on), its prompt re-queued and counted in
  ``rollout/dropped_stale``. η = 0 is on-policy: every trained token has version v.
  ``consume_order`` picks the order: ``fifo`` (finish order), ``oldest_first`` (the unit with the
  oldest token version first, then finish order: a sample about to go stale is taken before a
  fresher one that could wait), ``wait_oldest`` (oldest_first, and the batch also waits for the
  in-flight episodes admitted at version ``≤ v − η``, which would be stale at the next batch).
  Long responses finish late, so under ``fifo`` they are the ones dropped (starved); the drop
  rate per response-length quartile is ``rollout/stale_drop_frac_q{1..4}`` and every dropped
  sample is kept for the run's audit (``take_dropped``). benchmarks/scheduler_stale.py measures
  the three orders side by side.
- ``sync`` mode: episodes are admitted only while a ``next_batch`` call waits, up to the batch it
  asked for (no generation while the trainer trains).

Every method must run on the scheduler's event loop (the trainer uses ``rollout.async_bridge``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from sao_megatron.config.schema import DataConfig, RolloutConfig, SchedulerConfig
from sao_megatron.envs import build_reward_schedule
from sao_megatron.envs.base import Prompt, Task
from sao_megatron.envs.rewards import RewardPool, RewardSchedule
from sao_megatron.rollout.types import EngineError, SamplingParams
from sao_megatron.scheduler.admission import AdmissionBudget
from sao_megatron.scheduler.episode import Episode, EpisodeDiscarded, EpisodeRunner
from sao_megatron.scheduler.finished import FinishedQueue
from sao_megatron.scheduler.prompts import PromptCursor, PromptRef
from sao_megatron.scheduler.sample import Sample
from sao_megatron.scheduler.stats import RolloutStats

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Unit:
    """The episodes started together for one prompt (G in group mode, else 1)."""

    ref: PromptRef
    group_id: int
    tasks: list[asyncio.Task] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    dead: bool = False


class _Version:
    """A scheduler's own version holder when nobody shares one with it."""

    __slots__ = ("version",)

    def __init__(self, version: int):
        self.version = int(version)


class AsyncScheduler:
    """Keeps episodes in flight against the engines and hands finished samples to the trainer."""

    def __init__(self, client, task: Task, sched_cfg: SchedulerConfig, sampling: SamplingParams, *,
                 group_size: int = 1, prompts: list[Prompt] | None = None, reward_pool: RewardPool | None = None,
                 schedule: RewardSchedule | None = None, max_turns: int = 1, max_total_tokens: int = 1 << 20,
                 reward_workers: int = 2, reward_timeout_s: float = 10.0, version: int = 0, seed: int = 0,
                 shuffle: bool = True, return_routed_experts: bool = False, max_attempts: int = 3,
                 max_engine_retries: int = 5, retry_backoff_s: float = 0.5, mode: str | None = None,
                 served=None) -> None:
        """``served``: the object holding the served weight version (``.version``), shared with whoever
        publishes the weights (``weights.readmission.CurrentWeights``); None: this scheduler's own."""
        self.cfg, self.client, self.task = sched_cfg, client, task
        self._served = served if served is not None else _Version(version)
        # The resolved mode (build_components resolves "auto" from the objective; the config is not mutated).
        self.mode = mode if mode is not None else sched_cfg.mode
        if self.mode not in ("single", "group", "sync"):
            raise ValueError(f"scheduler mode {self.mode!r} must be resolved to single, group or sync first "
                             "(config.validate.resolved_mode)")
        self.group_size = group_size if self.mode != "single" else 1
        self._check_sizes()
        self.prompts = prompts if prompts is not None else task.prompts()
        self.schedule = schedule or RewardSchedule([])
        self.max_attempts = max_attempts
        self._own_pool = reward_pool is None
        self.reward_pool = reward_pool or RewardPool(reward_workers, reward_timeout_s)
        self._stats = RolloutStats()
        self._gate = asyncio.Event()  # set while generation may run (cleared during weight updates)
        self._gate.set()
        self.runner = EpisodeRunner(client, task, sampling, max_turns=max_turns, max_total_tokens=max_total_tokens,
                                    partial_rollout=sched_cfg.partial_rollout, gate=self._gate, stats=self._stats,
                                    return_routed_experts=return_routed_experts,
                                    max_engine_retries=max_engine_retries, retry_backoff_s=retry_backoff_s)
        self._cursor = PromptCursor(len(self.prompts), seed=seed, shuffle=shuffle)
        self._fifo = FinishedQueue(sched_cfg.consume_order, sched_cfg.max_staleness)
        self._fifo_event = asyncio.Event()
        self._units: dict[int, _Unit] = {}
        self._episodes: dict[int, Episode] = {}
        self._budget = AdmissionBudget(sched_cfg, group_size=self.group_size, mode=self.mode, version=version)
        self._next_uid = self._next_gid = 0
        self._update_lock = asyncio.Lock()
        self._consecutive_failures = 0
        self._fatal: BaseException | None = None
        self._running = self._stopping = False

    @property
    def version(self) -> int:
        """The trainer's policy version: the weights the engines serve (read from ``served``)."""
        return self._served.version

    @version.setter
    def version(self, value: int) -> None:
        self._served.version = int(value)

    @property
    def num_started(self) -> int:
        """Episodes admitted whose sample may still be trained on (see the module docstring)."""
        return self._budget.num_started

    @num_started.setter
    def num_started(self, value: int) -> None:
        self._budget.num_started = value

    @property
    def _in_flight(self) -> int:
        return self._budget.in_flight

    @classmethod
    def from_config(cls, client, task: Task, sched_cfg: SchedulerConfig, data_cfg: DataConfig,
                    rollout_cfg: RolloutConfig, *, group_size: int = 1, version: int = 0,
                    schedule: RewardSchedule | None = None, mode: str | None = None,
                    served=None) -> AsyncScheduler:
        """The scheduler as configured by the scheduler, data and rollout sections (phases from
        ``data_cfg.phases`` unless ``schedule`` is given)."""
        schedule = schedule or build_reward_schedule(data_cfg)
        sampling = SamplingParams(max_new_tokens=rollout_cfg.max_new_tokens, temperature=rollout_cfg.temperature,
                                  top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k)
        return cls(client, task, sched_cfg, sampling, group_size=group_size, schedule=schedule,
                   max_turns=data_cfg.max_turns, max_total_tokens=data_cfg.max_total_tokens,
                   reward_workers=data_cfg.reward_workers, reward_timeout_s=data_cfg.reward_timeout_s,
                   version=version, seed=data_cfg.seed, return_routed_experts=rollout_cfg.routing_replay,
                   mode=mode, served=served)

    def _check_sizes(self) -> None:
        c, g = self.cfg, self.group_size
        if c.batch_size < 1 or c.concurrency < 1 or c.max_staleness < 0 or g < 1:
            raise ValueError("scheduler.batch_size, scheduler.concurrency and group_size must be >= 1 and "
                             "scheduler.max_staleness >= 0")
        if c.batch_size % g:
            raise ValueError(f"scheduler.batch_size={c.batch_size} must be a multiple of the group size {g}")
        if g > c.concurrency:
            raise ValueError(f"scheduler.concurrency={c.concurrency} is below the group size {g}: "
                             "a group could never start; raise scheduler.concurrency")

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Start the reward workers and admit the first episodes."""
        if self._running:
            return
        await self.reward_pool.start()
        self._running = True
        self._admit()

    async def stop(self) -> None:
        """Cancel every episode (their engine requests are aborted) and release the workers."""
        self._stopping = True
        tasks = [t for u in self._units.values() for t in u.tasks]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.runner.drain_aborts()
        self.runner.close()
        if self._own_pool:
            self.reward_pool.close()
        self._running = False

    # ------------------------------------------------------------------ admission
    def admission_limit(self) -> int:
        """Largest ``num_started`` allowed now: ``(v + η + 1)·B`` (rebased, see module docstring)."""
        return self._budget.limit(self.version)

    def _can_admit(self) -> bool:
        if not self._running or self._stopping or self._fatal or not self._gate.is_set():
            return False
        return self._budget.allows_unit(self.version, self._stats.counters["trained"])

    def _admit(self) -> None:
        while self._can_admit():
            ref = self._cursor.next()
            unit = _Unit(ref=ref, group_id=self._next_gid)
            self._next_gid += 1
            self._units[unit.group_id] = unit
            for _ in range(self.group_size):
                ep = Episode(uid=self._next_uid, ref=ref, prompt=self.prompts[ref.index], group_id=unit.group_id,
                             admitted_version=self.version)
                self._next_uid += 1
                self._episodes[ep.uid] = ep
                unit.tasks.append(asyncio.create_task(self._run_episode(unit, ep), name=f"episode-{ep.uid}"))
            self._budget.started()
            self._stats.add("admitted", self.group_size)

    def set_version(self, version: int) -> None:
        """The trainer's policy version (the weights the engines now serve)."""
        self.version = version
        self._admit()

    def reset_admission_budget(self) -> None:
        """Count admissions afresh from now (after batches consumed without a policy update)."""
        self._budget.rebase(self._stats.counters["trained"], self.version)
        self._admit()

    # ------------------------------------------------------------------ episodes
    async def _run_episode(self, unit: _Unit, ep: Episode) -> None:
        try:
            sample = await self.runner.rollout(ep)
            if not self._engine_version_ok(sample, ep):
                return  # fatal: the unit stays pending (re-queued by state_dict); next_batch raises
            await self._score(sample, ep)
            self._consecutive_failures = 0
            self._member_done(unit, sample)
        except asyncio.CancelledError:
            pass  # group abandoned or scheduler stopping: the unit's accounting is done by whoever cancelled
        except EpisodeDiscarded:
            self._abandon(unit, "discarded")
        except Exception as exc:  # noqa: BLE001 - one episode must never take the run down
            logger.error("episode %d (prompt %d) failed: %s", ep.uid, ep.ref.index, exc, exc_info=exc)
            self._consecutive_failures += 1
            if self._consecutive_failures >= max(8, self.cfg.concurrency):
                self._set_fatal(RuntimeError(f"{self._consecutive_failures} episodes failed in a row, "
                                             f"last: {exc!r}"))
            self._abandon(unit, "failed")
        finally:
            self._episodes.pop(ep.uid, None)
            self._budget.in_flight -= 1
            if not self._stopping:
                self._admit()
                if self._in_flight == 0 or self.cfg.consume_order == "wait_oldest":
                    self._fifo_event.set()  # wake next_batch to re-check progress (and what it waits for)

    def _engine_version_ok(self, s: Sample, ep: Episode) -> bool:
        """Engine weights only move forward: a token older than the episode's start means the
        engines do not serve the trainer's version (dropping such samples as stale would loop forever)."""
        oldest = s.oldest_version()
        if oldest is not None and oldest < ep.admitted_version:
            self._set_fatal(RuntimeError(
                f"an engine generated tokens with weight version {oldest} for an episode started at trainer "
                f"version {ep.admitted_version}: the engines do not serve the trainer's weights. Push the weights "
                "before set_version(), or use on_weights_updated(version, push)."))
            return False
        return True

    async def _score(self, s: Sample, ep: Episode) -> None:
        s.phase = self.schedule.phase_at(self.version)
        t0 = time.monotonic()
        try:
            fn, args = self.task.reward_call(ep.prompt, s.response_ids, s.action_mask,
                                             self.schedule.phases[s.phase].target)
        except Exception as exc:  # noqa: BLE001 - a broken reward is a zero reward, not a crash
            logger.warning("reward for prompt %d could not be prepared: %r -> 0", ep.ref.index, exc)
            s.reward, s.reward_error = 0.0, f"exception: {exc!r}"
        else:
            out = await self.reward_pool.score(fn, *args)
            s.reward, s.reward_info, s.reward_error = out.reward, out.info, out.error
        if s.reward_error is not None:
            self._stats.add("reward_errors")
        s.timings.update(ep.timings, reward=time.monotonic() - t0, end=time.time())

    def _member_done(self, unit: _Unit, sample: Sample) -> None:
        if unit.dead:
            return
        unit.samples.append(sample)
        if len(unit.samples) == self.group_size:
            del self._units[unit.group_id]
            self._fifo.append(sorted(unit.samples, key=lambda s: s.timings["end"]))
            self._fifo_event.set()

    def _abandon(self, unit: _Unit, why: str) -> None:
        """Drop a unit that can no longer complete; re-queue its prompt (or give up after max_attempts)."""
        if unit.dead:
            return
        unit.dead = True
        current = asyncio.current_task()
        for t in unit.tasks:
            if t is not current:
                t.cancel()
        self._units.pop(unit.group_id, None)
        self.num_started -= self.group_size
        self._stats.add(why, self.group_size)
        if why == "failed" and unit.ref.attempt >= self.max_attempts:
            logger.error("prompt %d failed %d times; skipping it", unit.ref.index, unit.ref.attempt)
        else:
            self._cursor.requeue(unit.ref)

    def _set_fatal(self, exc: BaseException) -> None:
        self._fatal = exc
        self._fifo_event.set()

    # ------------------------------------------------------------------ consumption
    async def next_batch(self, batch_size: int | None = None, *, version: int | None = None) -> list[Sample]:
        """The first ``batch_size`` finished samples (whole groups in group mode), stale ones dropped.

        ``version``: the trainer's version that will train them (default: the served one). It is ahead of
        the served version while a weight push overlaps training; staleness is judged against it."""
        size = batch_size or self.cfg.batch_size
        version = self.version if version is None else version
        if size % self.group_size:
            raise ValueError(f"batch size {size} must be a multiple of the group size {self.group_size}")
        if not self._running:
            raise RuntimeError("AsyncScheduler.next_batch before start()")
        taken: list[list[Sample]] = []
        if self.mode == "sync":
            self._budget.sync_request = size
            self._admit()
        try:
            await self._collect(taken, size, version)
        except BaseException:
            self._fifo.put_back(taken)  # a cancelled call loses nothing
            raise
        finally:
            self._budget.sync_request = None
        samples = [s for unit in taken for s in unit]
        now = time.time()
        for s in samples:
            s.timings["queue"] = now - s.timings["end"]
        self._stats.add("trained", len(samples))
        self._stats.observe_consumed(samples, version)
        return samples

    async def _collect(self, taken: list[list[Sample]], size: int, version: int) -> None:
        n = 0
        while n < size:
            if self._fatal is not None:
                raise RuntimeError(f"rollout failed: {self._fatal}") from self._fatal
            if not self._fifo.ready(size - n, version, (ep.admitted_version for ep in self._episodes.values())):
                self._check_progress(size - n)
                self._fifo_event.clear()
                await self._fifo_event.wait()
                continue
            unit = self._fifo.pop(version)
            if self._fifo.is_stale(unit, version):
                self._drop_stale(unit, version)
                continue
            taken.append(unit)
            n += len(unit)

    def take_dropped(self) -> list[tuple[Sample, int]]:
        """The samples dropped as stale since the last call, each with the trainer version it was dropped
        at (for the run's audit; their prompts were re-queued)."""
        return self._fifo.take_dropped()

    def _check_progress(self, missing: int) -> None:
        if self._in_flight == 0 and self._gate.is_set() and not self._can_admit():
            raise RuntimeError(
                f"next_batch waits for {missing} samples but nothing is in flight and no episode may start: "
                f"num_started={self.num_started}, admission limit (v+eta+1)*B={self.admission_limit()} at v="
                f"{self.version}. Call on_weights_updated()/set_version() after each policy update, or "
                "reset_admission_budget() when consuming batches without one (value pretraining).")

    def _drop_stale(self, unit: list[Sample], version: int) -> None:
        s = unit[0]
        self.num_started -= len(unit)
        self._stats.add("dropped_stale", len(unit))
        self._stats.observe_dropped(unit, version)
        self._fifo.record_dropped(unit, version)
        self._cursor.requeue(PromptRef(s.epoch, s.index, s.attempt))
        self._admit()

    # ------------------------------------------------------------------ weight updates
    async def on_weights_updated(self, version: int, update_fn: Callable[[], Awaitable[None]] | None = None) -> None:
        """Pause every engine (``partial_rollout`` mode), await ``update_fn()`` (the caller pushes the
        weights tagged ``version``), set the version, continue generation."""
        async with self.paused(version):
            if update_fn is not None:
                await update_fn()

    @contextlib.asynccontextmanager
    async def paused(self, version: int) -> AsyncIterator[None]:
        """Generation paused for the body (the caller pushes the weights tagged ``version``): on success the
        version is set; on every path the engines paused are continued and admission reopens."""
        async with self._update_lock:
            self._gate.clear()
            for ep in self._episodes.values():
                if ep.generating:
                    ep.interrupted = True
                    ep.num_interruptions += 1
                    self._stats.add("interrupted")
            # The pause is inside the try: when every engine dies between the caller's health check
            # and this call, the error must not leave the admission gate closed for good.
            try:
                try:
                    await self.client.pause_generation(self.runner.pause_mode)
                    yield
                    self.version = version
                except BaseException:
                    try:  # engines left paused would never generate again; the first error says more
                        await self.client.continue_generation()
                    except EngineError as exc:
                        logger.warning("continue_generation after a failed weight update: %s", exc)
                    raise
                await self.client.continue_generation()
            finally:
                self._gate.set()
                self._admit()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Everything needed to resume without losing or repeating a prompt (JSON-serialisable).

        In-flight and incomplete-group prompts are stored as re-queued: on resume they start again.
        """
        cursor = self._cursor.state_dict()
        in_flight = sorted(self._units.values(), key=lambda u: u.group_id)
        cursor["requeued"] += [[u.ref.epoch, u.ref.index, u.ref.attempt + 1] for u in in_flight if not u.dead]
        return {"version": self.version, "cursor": cursor, "counters": dict(self._stats.counters),
                "fifo": self._fifo.state(),
                "base": [self._budget.base_started, self._budget.base_version], "next_uid": self._next_uid,
                "next_gid": self._next_gid, "mode": self.mode, "group_size": self.group_size}

    def load_state_dict(self, state: dict) -> None:
        """Restore a ``state_dict`` (before ``start()``)."""
        if self._running:
            raise RuntimeError("load_state_dict must be called before start()")
        if state["group_size"] != self.group_size:
            raise ValueError(f"checkpointed scheduler used group size {state['group_size']}, now {self.group_size}")
        self.version = state["version"]
        self._cursor.load_state_dict(state["cursor"])
        self._stats.counters.update(state["counters"])
        self._fifo.load(state["fifo"])
        self._budget.rebase(*state["base"])
        self._next_uid, self._next_gid = state["next_uid"], state["next_gid"]
        self.num_started = self._stats.counters["trained"] + self._fifo.num_samples()
        if self._fifo:
            self._fifo_event.set()

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, float]:
        """``rollout/*`` metrics over the samples consumed since the last call, plus counters and depths."""
        # Through a router the client cannot attribute requests to engines: no utilisation (see stats).
        routed = getattr(self.client, "router_url", None) is not None
        out = self._stats.report([] if routed else self.client.engine_urls,
                                 engine_of=getattr(self.client, "engine_of", None))
        out.update({
            "rollout/version": float(self.version), "rollout/num_started": float(self.num_started),
            "rollout/admission_limit": float(self.admission_limit()),
            "rollout/fifo_samples": float(self._fifo.num_samples()),
            "rollout/in_flight": float(self._in_flight),
            "rollout/generating": float(sum(ep.generating for ep in self._episodes.values())),
            "rollout/pending_groups": float(sum(bool(u.samples) for u in self._units.values())),
            "rollout/requeue_depth": float(len(self._cursor.requeued)),
            "rollout/epoch": float(self._cursor.epoch)})
        return out
