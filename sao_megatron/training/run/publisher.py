"""The one owner of weight publishing: export → transport → pause and commit → version → reconnects.

Every trainer rank holds a :class:`WeightPublisher`; the trainer calls :meth:`WeightPublisher.publish`
once per policy update. In order, it
1. exports the actor's weights (``rollout.weight_sync=disk``: gathered to rank 0, written while the
   engines keep generating; ``distributed``: every owner streams its own share),
2. moves them with the transport (``rollout.weight_sync``), loading them while generation is paused
   (the scheduler's ``on_weights_updated``),
3. commits the version: :attr:`served` (``rollout.recovery.CurrentWeights``) is the ONE record of the
   weight version every engine serves. Rank 0 hands the same object to the client (whose health probe
   keeps out an engine serving another version), the scheduler (its policy version for staleness) and
   the supervisor (what a restarted engine loads): nothing else holds a copy that could drift,
4. reconnects engines the supervisor restarted (distributed: their update groups are rebuilt on every
   rank before the next push; disk: they load :attr:`served` on readmission).

While a push is in flight ``served.pending`` names the version being loaded, so an engine that already
took it is not judged stale by a health probe during the push.

With ``rollout.overlap_weight_push`` (docs/weight-publishing.md#overlap) the push runs on a background
thread while the next step trains. Two versions then exist: :attr:`WeightPublisher.version` (the actor's:
updates applied and exported) and ``served.version`` (the engines', which lags while a push is in
flight). At most one push is in flight: :meth:`WeightPublisher.wait` (collective) joins it and raises its
error on every rank, naming its version and step.
"""

from __future__ import annotations

import concurrent.futures
import logging
import pathlib
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from sao_megatron.config import ExperimentConfig
from sao_megatron.config.schema import RolloutConfig
from sao_megatron.errors import SaoError
from sao_megatron.models.families.hf_config import dtype_name
from sao_megatron.parallel.collectives import broadcast_object, rank0_call
from sao_megatron.rollout.recovery import CurrentWeights, PendingReconnects, disk_readmit
from sao_megatron.rollout.types import EngineUnavailable
from sao_megatron.training.run.components import Components, drain, export_weights
from sao_megatron.training.run.export import iter_owned_hf_tensors, owns_tensors

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

    def __init__(self, cfg: ExperimentConfig, components: Components, run_dir: pathlib.Path, *, rank0: bool):
        self.cfg, self.c, self.run_dir, self.rank0 = cfg, components, pathlib.Path(run_dir), rank0
        self.served = CurrentWeights(None, 0)
        self.rollout = None  # rank 0's RolloutSide
        self.disk = None  # rank 0: the engines' start directory, restarts and rollout.weight_sync=disk
        self.transport = None  # the sync publish() pushes with (the disk one, or distributed on every rank)
        self.reconnects = PendingReconnects()
        self._reconnecting: list = []
        self.distributed = cfg.rollout.weight_sync != "disk"
        self.version = 0
        """The actor's version: policy updates applied and exported (``served.version`` once no push is in flight)."""
        self.overlap = cfg.rollout.overlap_weight_push
        # η = 0: no sample generated before a push finished can be trained by the updated actor, so the next
        # batch waits for the push (the trainer asks); η ≥ 1 trains on the previous version's samples meanwhile.
        self.overlaps_batch = self.overlap and cfg.scheduler.max_staleness >= 1
        self._inflight: _Push | None = None
        self._finished: list[tuple[int | None, dict[str, float]]] = []  # (step, metrics) of joined pushes
        self._thread = (concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="weight-push", initializer=_push_thread_device,
            initargs=(torch.cuda.current_device() if torch.cuda.is_available() else None,)) if self.overlap else None)
        self._buffers: dict[str, torch.Tensor] = {}  # distributed + overlap: the snapshot, reused every push

    def restore(self, version: int) -> None:
        """A resumed run starts from its checkpoint's version."""
        self.version = version
        self.served.set(None, version)

    # ------------------------------------------------------------------ start (collective)
    def start(self, build_rollout: Callable[[], Any], scheduler_state: dict[str, Any] | None):
        """Write the current weights, start (or reach) the engines with them, start generating, connect
        the transport. ``build_rollout`` (rank 0) makes the RolloutSide; returns it on rank 0."""
        gen = export_weights(self.c)

        def start():
            try:
                self._start_rank0(build_rollout, gen, scheduler_state)
            finally:
                drain(gen)

        rank0_call(start, others=lambda: drain(gen))
        if self.distributed:
            from sao_megatron.rollout.weight_sync import build_weight_sync

            # A background push runs the transport's object collectives on a group of its own: the
            # default group belongs to the main thread (a group must never be used by two threads at once).
            group = dist.new_group(backend="gloo") if self.overlap else None
            self.transport = build_weight_sync(self.cfg.rollout, client=None, run_dir=self.run_dir,
                                               template_dir=None, checkpoint_dtype=self._dtype(), world_group=group)
            self.transport.connect(self.rollout.client.engine_urls if self.rank0 else None,
                                   is_sender=owns_tensors(self.c.exporter))
        return self.rollout

    def _start_rank0(self, build_rollout, gen, scheduler_state) -> None:
        from sao_megatron.rollout.weight_sync import DiskWeightSync, Fp8BlockSync

        r: RolloutConfig = self.cfg.rollout
        self.rollout = build_rollout()
        self.disk = DiskWeightSync(client=None, sync_root=self.rollout.weights_root,
                                   template_dir=self.rollout.template_dir, collective=False,
                                   verify=r.weight_sync_verify, api_key=r.api_key, timeout_s=r.weight_sync_timeout_s,
                                   strict_names=r.engine == "embedded", checkpoint_dtype=self._dtype(),
                                   quantized=r.engine_weight_format == "fp8_block")
        model_dir, _ = self.disk.write(gen, self.version)
        self.served.set(model_dir, self.version)
        client = self.rollout.start_engines(model_dir, self.version, served=self.served)
        self.disk.client = client
        if r.engine == "sglang":
            # External servers started from their own weights: serve the actor's (initial or resumed)
            # weights before the first rollout, tagged with the trainer's version.
            self.rollout.bridge.run(client.update_weights_from_disk(str(model_dir), weight_version=self.version))
        if not self.distributed:
            self.disk.connect(client.engine_urls, is_sender=True)
            self.transport = Fp8BlockSync(self.disk) if r.engine_weight_format == "fp8_block" else self.disk
        readmit = (self.reconnects.readmit if self.distributed
                   else disk_readmit(client, self.served, on_admit=self.disk.reconnect))
        self.rollout.start_generation(self.served, readmit=readmit, scheduler_state=scheduler_state)

    def _dtype(self) -> str:
        return dtype_name(self.cfg.model.params_dtype)

    # ------------------------------------------------------------------ one push per step (collective)
    def publish(self, step: int | None = None) -> dict[str, float]:
        """Collective: export, push and commit version + 1 on every engine (``step``: the step that made it).

        Synchronous, or with ``rollout.overlap_weight_push`` started in the background after waiting for the
        previous push (whose error raises here). Returns rank 0's ``timing/weight_sync_s`` (the time this
        call blocked) and ``timing/weight_push_wait_s`` (of it, waiting for the previous push), and when
        synchronous the push's own metrics. An overlapped push's metrics come from :meth:`take_finished`
        once it was joined, with the step that published it."""
        t0 = time.perf_counter()
        self.wait()
        done: dict[str, float] = {}
        waited = time.perf_counter() - t0
        version = self.version + 1
        job = self._prepare(version)  # the export's collectives and the snapshot: on this (the main) thread
        if self.overlap:
            self._inflight = _Push(version, step, self._thread.submit(_timed, job))
        else:
            done = _timed(job)
        self.version = version
        if not self.rank0:
            return {}
        return done | {"timing/weight_sync_s": time.perf_counter() - t0, "timing/weight_push_wait_s": waited}

    def _prepare(self, version: int) -> Callable[[], dict[str, float]]:
        """Everything of a push that runs collectives over the trainer's groups or reads the actor's
        parameters; returns the rest (transport push, pause, commit), which may run on another thread."""
        paused = self._paused(version) if self.rank0 else None
        if self.distributed:
            self._reconnect_restarted()
            sender, owned = self._sender(iter_owned_hf_tensors(self.c.exporter))
            if self.overlap:  # the next optimizer step may change the parameters while the push reads them
                owned = self._snapshot(owned)

            def push() -> dict[str, float]:
                out = sender.push(owned, version, paused=paused)
                if self.rank0:  # restarted engines the push reached serve again
                    self._admit_reconnected({l.url for l in self.transport.links if l.failed is None})
                else:
                    self.served.set(None, version)  # rank 0 committed inside the pause
                return _metrics(out or {})
            return push
        gen = export_weights(self.c)
        if not self.overlap:  # rank 0 writes the export while the engines generate, then loads it
            return lambda: _metrics(rank0_call(lambda: self.transport.push(gen, version, paused=paused),
                                               others=lambda: drain(gen)) or {})
        # The written directory is the snapshot: the next update cannot change it, and host memory stays
        # at one shard (rollout.weight_sync's disk writer) whatever the model's size.
        verify = self.rank0 and self.disk.needs_verify
        written = rank0_call(lambda: self._write(gen, version, verify), others=lambda: drain(gen))
        if not self.rank0:
            return lambda: {}
        path, sums, seconds = written
        return lambda: _metrics(self.disk.load_written(path, version, sums, verify=verify, paused=paused) |
                                {"weight_sync/write_seconds": seconds})

    def _write(self, gen, version: int, verify: bool) -> tuple[pathlib.Path, dict, float]:
        t0 = time.perf_counter()
        try:
            _, owned = self._sender(gen)
            path, sums = self.disk.write(owned, version, checksums=verify)
        finally:
            drain(gen)
        return path, sums, time.perf_counter() - t0

    def _sender(self, owned: Iterable[tuple[str, torch.Tensor]]):
        """The transport that sends and what it sends: an FP8 wrapper's quantization runs here, on the main
        thread, so that a snapshot holds what the engines load (and half the bytes)."""
        from sao_megatron.rollout.weight_sync import Fp8BlockSync

        if isinstance(self.transport, Fp8BlockSync):
            from sao_megatron.rollout.fp8_weights import requantize

            return self.transport.inner, requantize(owned, self.transport.scheme)
        return self.transport, owned

    def _snapshot(self, owned: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """This rank's share of the export copied into host buffers reused by every push.

        Why a copy rather than holding the next optimizer step until the push read the parameters: the TP
        gathers that assemble the share are collectives over the training groups and must run on the main
        thread before it trains again, so the gathered tensors have to be kept either way. Host memory is
        the rank's owned share (all ranks together: one copy of the model); GPU memory is unchanged, since
        the transport stages one bucket (rollout.weight_sync_bucket_mb) at a time onto the device."""
        pin = torch.cuda.is_available()
        out = []
        for name, tensor in owned:
            buf = self._buffers.get(name)
            if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                buf = self._buffers[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            buf.copy_(tensor)
            out.append((name, buf))
        return out

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
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}")
        first = next((e for e in errors if e), None)
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

    def _paused(self, version: int) -> Callable[[Callable[[], Awaitable[None]]], None]:
        """(rank 0) Runs a transport's update coroutine with generation paused; commits ``version``."""
        rollout, served = self.rollout, self.served
        path = self.disk.sync_root / f"v{version:06d}" if not self.distributed else None

        def run(update: Callable[[], Awaitable[None]]) -> None:
            async def locked() -> None:  # engine admissions wait: none may miss this push
                async with served.lock:
                    served.pending = version
                    try:
                        await update()
                        served.set(path, version)
                    finally:
                        served.pending = None
            if not self.distributed and not rollout.client.healthy_urls():
                # Every engine is down (restarting): nothing to pause or load; they load these on readmission.
                rollout.bridge.run(self._record(path, version))
                return
            try:
                rollout.bridge.run(rollout.scheduler.on_weights_updated(version, locked))
            except EngineUnavailable as exc:
                if rollout.client.healthy_urls():
                    raise
                # The last engines died during the push. As when they were down before it: the weights
                # are recorded, restarted engines load them on readmission, and the next batch waits
                # for an engine (NoEngineError after rollout.no_engine_timeout_s).
                log.warning("every engine failed during the v%d weight push (%s); engines readmitted "
                            "later load these weights", version, exc)
                rollout.bridge.run(self._record(path, version))
        return run

    async def _record(self, path, version: int) -> None:
        async with self.served.lock:
            self.served.set(path, version)
        self.rollout.scheduler.set_version(version)

    # ------------------------------------------------------------------ restarted engines (distributed)
    def _reconnect_restarted(self) -> None:
        """Collective: rebuild the update groups of engines restarted since the last push."""
        from sao_megatron.rollout.weight_sync_distributed import WeightSyncError

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


def _timed(job: Callable[[], dict[str, float]]) -> dict[str, float]:
    t0 = time.perf_counter()
    out = job()
    return out | {"timing/weight_push_s": time.perf_counter() - t0} if out else out


def _metrics(out: dict[str, float]) -> dict[str, float]:
    """The transport's metrics under the trainer's names (both transports report bytes)."""
    named = {"rollout/weight_sync_bytes": out.get("weight_sync/bytes", 0.0)}
    if "weight_sync/write_seconds" in out:
        named |= {"timing/weight_write_s": out["weight_sync/write_seconds"],
                  "timing/weight_update_s": out["weight_sync/load_seconds"]}
    return named | out
