"""The one owner of weight publishing: export → stage → pause, deliver, commit → reconnects.

Every trainer rank holds a :class:`WeightPublisher`; the trainer calls :meth:`WeightPublisher.publish`
once per policy update. A push reads top to bottom:

1. ``job = transport.stage(export, version)`` (main thread, collective): the export's gathers and the
   transport's staging (``rollout.weight_sync.transport=disk``: gathered to rank 0 and written while the engines
   keep generating; ``distributed``: each owner's share, snapshotted into host buffers when overlapped).
   The transport is picked once, at :meth:`start` (``weights.transports``); the publisher never looks
   inside it.
2. ``job.deliver()`` with generation paused: rank 0 pauses through the scheduler
   (``scheduler.paused``, which continues every engine it paused on every path), holds the served
   lock (no engine is admitted mid-push) and delivers; the other ranks of a distributed push send their
   buckets unpaused.
3. The version is committed once, in :meth:`_commit`: :attr:`served` (``weights.readmission.
   CurrentWeights``) is the ONE record of the version every engine serves. Rank 0 hands the same object
   to the client (whose health probe keeps out an engine serving another version), the scheduler (its
   policy version for staleness) and the supervisor (what a restarted engine loads).
4. ``job.finish()`` after the pause (verification, pruning, metrics); engines the supervisor restarted
   rejoin (distributed: their update groups are rebuilt on every rank before the next push and they are
   admitted once a push reached them; disk: they load :attr:`served` on readmission).

While a push is in flight ``served.pending`` names the version being loaded, so an engine that already
took it is not judged stale by a health probe during the push.

Concurrency map (rank 0; other ranks have no bridge and deliver on the push worker or main thread):

- main thread: ``publish`` → ``wait`` (joins the previous push, all-gathers its outcome) → ``_stage``
  (collectives over the training groups) → submits ``_deliver`` to the push worker (overlap) or runs it.
- push worker (``weight-push``, one thread, ``rollout.weight_sync.overlap``): ``_deliver`` →
  ``bridge.run(_deliver_paused)`` blocks on rank 0's asyncio bridge thread; its own process group for
  the transport's object collectives (a group is never used by two threads at once).
- bridge thread (``rollout-loop``): the scheduler pauses, ``_load`` takes ``served.lock`` and awaits
  ``job.deliver()``; a distributed delivery runs ``_send_all`` in a loop worker thread (the loop keeps
  serving generation requests and admissions queue on the lock); the disk delivery awaits the client.
- transport threads (distributed): ``wsync-send`` sends bucket k while the delivery flattens k+1;
  ``wsync-http`` opens and ends the engines' sessions.
Who waits: the main thread for the push worker only in ``wait`` (next publish, checkpoint, the end) and
``wait_local`` (evaluation); the push worker for the bridge; admissions for the push (the lock).

With ``rollout.weight_sync.overlap`` (docs/weight-publishing.md#overlap) two versions exist:
:attr:`WeightPublisher.version` (the actor's: updates applied and exported) and ``served.version`` (the
engines', which lags while a push is in flight). At most one push is in flight: :meth:`WeightPublisher.wait`
(collective) joins it and raises its error on every rank, naming its version and step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import pathlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sao_megatron.config import ExperimentConfig
from sao_megatron.config.schema import RolloutConfig, WeightSyncConfig
from sao_megatron.errors import SaoError
from sao_megatron.models.families.hf_config import dtype_name
from sao_megatron.parallel.collectives import broadcast_object, first_error, rank0_call
from sao_megatron.rollout.types import EngineUnavailable
from sao_megatron.weights.disk import DiskWeightSync
from sao_megatron.weights.export import ExportPlan, drain, export_weights, iter_owned_hf_tensors, owns_tensors
from sao_megatron.weights.readmission import CurrentWeights, PendingReconnects, disk_readmit
from sao_megatron.weights.staged import NothingStaged, Staged
from sao_megatron.weights.transports import Fp8BlockSync, build_weight_sync
from sao_megatron.weights.verify import WeightSyncError

log = logging.getLogger(__name__)


class WeightPushError(SaoError):
    """A weight push that ran in the background failed; raised at the next wait, naming its version and step."""


@dataclass
class _Push:
    """The push in flight (every rank holds one: publish and wait are collective)."""

    version: int
    step: int | None
    future: concurrent.futures.Future


class WeightPublisher:
    """Every rank's side of weight publishing (see the module docstring)."""

    def __init__(self, cfg: ExperimentConfig, exporter: ExportPlan | None, run_dir: pathlib.Path, *, rank0: bool):
        """``exporter``: the actor's export plan (``weights.export``)."""
        self.cfg, self.exporter, self.run_dir, self.rank0 = cfg, exporter, pathlib.Path(run_dir), rank0
        self.served = CurrentWeights(None, 0)
        self.rollout = None  # rank 0's RolloutSide
        self.disk = None  # rank 0: the engines' start directory, restarts and rollout.weight_sync.transport=disk
        self.transport = None  # the sync publish() pushes with (the disk one, or distributed on every rank)
        self.reconnects = PendingReconnects()
        self._reconnecting: list = []
        self.every_rank = cfg.rollout.weight_sync.transport != "disk"
        """Every rank sends its own share (distributed); else rank 0 pushes an export gathered to it (disk)."""
        self.version = 0
        """The actor's version: policy updates applied and exported (``served.version`` once no push is in flight)."""
        self.overlap = cfg.rollout.weight_sync.overlap
        # η = 0: no sample generated before a push finished can be trained by the updated actor, so the next
        # batch waits for the push (the trainer asks); η ≥ 1 trains on the previous version's samples meanwhile.
        self.overlaps_batch = self.overlap and cfg.scheduler.max_staleness >= 1
        self._inflight: _Push | None = None
        self._finished: list[tuple[int | None, dict[str, float]]] = []  # (step, metrics) of joined pushes
        self._thread = (concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="weight-push", initializer=_push_thread_device,
            initargs=(torch.cuda.current_device() if torch.cuda.is_available() else None,)) if self.overlap else None)

    def restore(self, version: int) -> None:
        """A resumed run starts from its checkpoint's version."""
        self.version = version
        self.served.set(None, version)

    # ------------------------------------------------------------------ start (collective)
    def start(self, build_rollout: Callable[[], Any], scheduler_state: dict[str, Any] | None):
        """Write the current weights, start (or reach) the engines with them, start generating, connect
        the transport. ``build_rollout`` (rank 0) makes the RolloutSide; returns it on rank 0."""
        gen = export_weights(self.exporter)

        def start():
            try:
                self._start_rank0(build_rollout, gen, scheduler_state)
            finally:
                drain(gen)

        rank0_call(start, others=lambda: drain(gen))
        if self.every_rank:
            # A background push runs the transport's object collectives on a group of its own: the
            # default group belongs to the main thread (a group must never be used by two threads at once).
            group = dist.new_group(backend="gloo") if self.overlap else None
            self.transport = build_weight_sync(self.cfg.rollout, client=None, run_dir=self.run_dir,
                                               template_dir=None, checkpoint_dtype=self._dtype(), world_group=group)
            self.transport.connect(self.rollout.client.engine_urls if self.rank0 else None,
                                   is_sender=owns_tensors(self.exporter))
        return self.rollout

    def _start_rank0(self, build_rollout, gen, scheduler_state) -> None:
        r: RolloutConfig = self.cfg.rollout
        ws: WeightSyncConfig = r.weight_sync
        self.rollout = build_rollout()
        self.disk = DiskWeightSync(client=None, sync_root=self.rollout.weights_root,
                                   template_dir=self.rollout.template_dir, collective=False,
                                   verify=ws.verify, api_key=r.api_key, timeout_s=ws.timeout_s,
                                   strict_names=r.engine == "embedded", checkpoint_dtype=self._dtype(),
                                   quantized=ws.format == "fp8_block")
        model_dir, _ = self.disk.write(gen, self.version)
        self.served.set(model_dir, self.version)
        client = self.rollout.start_engines(model_dir, self.version, served=self.served)
        self.disk.client = client
        if r.engine == "sglang":
            # External servers started from their own weights: serve the actor's (initial or resumed)
            # weights before the first rollout, tagged with the trainer's version.
            self.rollout.bridge.run(client.update_weights_from_disk(str(model_dir), weight_version=self.version))
        if not self.every_rank:
            self.disk.connect(client.engine_urls, is_sender=True)
            self.transport = Fp8BlockSync(self.disk) if ws.format == "fp8_block" else self.disk
        readmit = (self.reconnects.readmit if self.every_rank
                   else disk_readmit(client, self.served, on_admit=self.disk.reconnect))
        self.rollout.start_generation(self.served, readmit=readmit, scheduler_state=scheduler_state)

    def _dtype(self) -> str:
        return dtype_name(self.cfg.model.params_dtype)

    # ------------------------------------------------------------------ one push per step (collective)
    def publish(self, step: int | None = None) -> dict[str, float]:
        """Collective: export, push and commit version + 1 on every engine (``step``: the step that made it).

        Synchronous, or with ``rollout.weight_sync.overlap`` started in the background after waiting for the
        previous push (whose error raises here). Returns rank 0's ``timing/weight_sync_s`` (the time this
        call blocked) and ``timing/weight_push_wait_s`` (of it, waiting for the previous push), and when
        synchronous the push's own metrics. An overlapped push's metrics come from :meth:`take_finished`
        once it was joined, with the step that published it."""
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        version = self.version + 1
        staged_at = time.perf_counter()
        job = self._stage(version)  # the export's collectives, the snapshot or disk write: this thread
        done: dict[str, float] = {}
        if self.overlap:
            self._inflight = _Push(version, step, self._thread.submit(self._deliver, job))
        elif self.every_rank:  # the transport shares its verdict with every rank itself
            done = self._deliver(job)
        else:  # rank 0 loads alone (the others commit): its failure must stop the others too
            done = rank0_call(lambda: self._deliver(job), others=lambda: self._deliver(job)) or {}
        if done:  # synchronous: the push took the staging (export, write) and the delivery
            done["timing/weight_push_s"] = time.perf_counter() - staged_at
        self.version = version
        if not self.rank0:
            return {}
        return done | {"timing/weight_sync_s": time.perf_counter() - t0, "timing/weight_push_wait_s": waited}

    def _stage(self, version: int) -> Staged:
        """(main thread, collective) Everything of a push that runs collectives over the trainer's groups or
        reads the actor's parameters; the transport keeps what the delivery needs."""
        if self.every_rank:  # each owner sends its own share
            self._reconnect_restarted()
            return self.transport.stage(iter_owned_hf_tensors(self.exporter), version, snapshot=self.overlap)
        gen = export_weights(self.exporter)  # gathered to rank 0, which writes it while the engines generate

        def write() -> Staged:
            try:
                return self.transport.stage(gen, version)
            finally:
                drain(gen)
        return rank0_call(write, others=lambda: drain(gen)) or NothingStaged(version)

    def _deliver(self, job: Staged) -> dict[str, float]:
        """(main thread, or the push worker) Deliver a staged push and commit its version; its metrics."""
        t0 = time.perf_counter()
        if self.rank0:
            self.rollout.bridge.run(self._deliver_paused(job))
        else:
            asyncio.run(job.deliver())  # a distributed push: this rank's buckets; else nothing
            self._commit(job)
        out = job.finish()
        if self.rank0 and self._reconnecting:  # restarted engines the push reached serve again
            self._admit_reconnected(job.reached or set())
        return _metrics(out) | {"timing/weight_push_s": time.perf_counter() - t0} if out else {}

    async def _deliver_paused(self, job: Staged) -> None:
        """(rank 0, the bridge's loop) Generation paused → the engines take the push → commit → continue.
        The scheduler's pause continues every engine it paused whatever happens in its body."""
        client = self.rollout.client
        if not self.every_rank and not client.healthy_urls():
            # Every engine is down (restarting): nothing to pause or load; they load these on readmission.
            return await self._record(job)
        try:
            async with self.rollout.scheduler.paused(job.version):
                await self._load(job)
        except EngineUnavailable as exc:
            if client.healthy_urls():
                raise
            # The last engines died during the push. As when they were down before it: the weights are
            # recorded, restarted engines load them on readmission, and the next batch waits for an engine
            # (NoEngineError after rollout.no_engine_timeout_s).
            log.warning("every engine failed during the v%d weight push (%s); engines readmitted later load "
                        "these weights", job.version, exc)
            await self._record(job)

    async def _load(self, job: Staged) -> None:
        """(rank 0, generation paused) Engine admissions wait on the lock: none may miss this push."""
        async with self.served.lock:
            self.served.pending = job.version
            try:
                await job.deliver()
                self._commit(job)
            finally:
                self.served.pending = None

    async def _record(self, job: Staged) -> None:
        """(rank 0) No engine took the push: commit it for the engines readmitted later."""
        async with self.served.lock:
            self._commit(job)
        self.rollout.scheduler.set_version(job.version)

    def _commit(self, job: Staged) -> None:
        """The one place a push's version becomes the served one (rank 0: the directory with it)."""
        self.served.set(job.path if self.rank0 else None, job.version)

    def wait(self) -> dict[str, float]:
        """Collective: join the push in flight, if any; rank 0 gets its metrics (also kept for
        :meth:`take_finished`, so a wait before a checkpoint does not lose them). When it failed on any rank,
        every rank raises WeightPushError naming its version and step (ranks share the outcome, so none
        walks into the next collective alone)."""
        push, self._inflight = self._inflight, None
        if push is None:
            return {}
        out, error = {}, None
        try:
            out = push.future.result()
        except Exception as exc:  # shared below, then raised on every rank
            error = exc
        first = first_error(error)
        if first is not None:
            step = f"published after step {push.step}" if push.step is not None else "published"
            raise WeightPushError(f"the background weight push of version {push.version} ({step}) failed: "
                                  f"{first}") from error
        if not self.rank0:
            return {}
        self._finished.append((push.step, out))
        return out

    def take_finished(self) -> list[tuple[int | None, dict[str, float]]]:
        """(rank 0) The overlapped pushes joined since the last call: (the step that published it, its
        metrics), oldest first."""
        out, self._finished = self._finished, []
        return out

    @property
    def in_flight_step(self) -> int | None:
        """The step whose overlapped push is still in flight (None: none is)."""
        return self._inflight.step if self._inflight is not None else None

    def wait_local(self) -> None:
        """This rank only, no collective: block until the push in flight is done (rank 0 before an evaluation,
        which must sample from the published weights); its error is kept for the next :meth:`wait`."""
        if self._inflight is not None:
            concurrent.futures.wait([self._inflight.future])

    # ------------------------------------------------------------------ restarted engines (distributed)
    def _reconnect_restarted(self) -> None:
        """Collective: rebuild the update groups of engines restarted since the last push."""
        self._reconnecting = self.reconnects.take() if self.rank0 else []
        pairs = broadcast_object([(old, new) for old, new, _ in self._reconnecting] if self.rank0 else None)
        for old, new in pairs:
            try:  # raised on every rank alike (rank 0's verdict is shared): the engine stays out
                self.transport.reconnect(old if self.rank0 else None, new if self.rank0 else None)
            except WeightSyncError as exc:
                log.error("restarted engine %s could not rejoin the weight sync: %s", new, exc)

    def _admit_reconnected(self, reached: set[str]) -> None:
        """After the push: route to the reconnected engines it reached; the others retry next push."""
        for old, new, admit in self._reconnecting:
            if new in reached:
                self.rollout.bridge.run(admit(new))
            else:
                self.rollout.bridge.run(self.reconnects.readmit(old, new, admit))
        self._reconnecting = []

    def close(self) -> None:
        """Waits for a push in flight (this rank; its error is logged: a caller that wanted it raised
        called :meth:`wait`), then closes the transports."""
        if self._inflight is not None:
            push, self._inflight = self._inflight, None
            if (exc := push.future.exception()) is not None:
                log.error("the background weight push of version %d failed: %s", push.version, exc)
        if self._thread is not None:
            self._thread.shutdown(wait=True)
        if self.transport is not None and self.transport is not self.disk:
            self.transport.close()
        if self.disk is not None:
            self.disk.close()


def _push_thread_device(device: int | None) -> None:
    """The push thread uses this rank's GPU (a new thread's CUDA device is 0) on a stream of its own, so its
    copies and broadcasts do not queue behind the training kernels of the default stream."""
    if device is not None:
        torch.cuda.set_device(device)
        torch.cuda.set_stream(torch.cuda.Stream(device))


def _metrics(out: dict[str, float]) -> dict[str, float]:
    """The transport's metrics under the trainer's names (both transports report bytes)."""
    named = {"rollout/weight_sync_bytes": out.get("weight_sync/bytes", 0.0)}
    if "weight_sync/write_seconds" in out:
        named |= {"timing/weight_write_s": out["weight_sync/write_seconds"],
                  "timing/weight_update_s": out["weight_sync/load_seconds"]}
    return named | out
