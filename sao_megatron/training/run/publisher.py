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
"""

from __future__ import annotations

import logging
import pathlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sao_megatron.config import ExperimentConfig
from sao_megatron.config.schema import RolloutConfig
from sao_megatron.models.families.hf_config import dtype_name
from sao_megatron.parallel.collectives import broadcast_object, rank0_call
from sao_megatron.rollout.recovery import CurrentWeights, PendingReconnects, disk_readmit
from sao_megatron.rollout.types import EngineUnavailable
from sao_megatron.training.run.components import Components, drain, export_weights
from sao_megatron.training.run.export import iter_owned_hf_tensors, owns_tensors

log = logging.getLogger(__name__)


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

    @property
    def version(self) -> int:
        return self.served.version

    def restore(self, version: int) -> None:
        """A resumed run starts from its checkpoint's version."""
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

            self.transport = build_weight_sync(self.cfg.rollout, client=None, run_dir=self.run_dir,
                                               template_dir=None, checkpoint_dtype=self._dtype())
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
    def publish(self) -> dict[str, float]:
        """Export, push and commit version + 1 on every engine; returns rank 0's metrics."""
        t0, version = time.perf_counter(), self.version + 1
        if self.distributed:
            self._reconnect_restarted()
            out = self.transport.push(iter_owned_hf_tensors(self.c.exporter), version,
                                      paused=self._paused(version) if self.rank0 else None)
            if self.rank0:  # restarted engines the push reached serve again
                self._admit_reconnected({l.url for l in self.transport.links if l.failed is None})
        else:  # rank 0 writes the export while the engines generate
            gen = export_weights(self.c)
            out = rank0_call(lambda: self.transport.push(gen, version, paused=self._paused(version)),
                             others=lambda: drain(gen))
        if not self.rank0:
            self.served.set(None, version)  # rank 0 committed inside the pause
            return {}
        return _metrics(out or {}) | {"timing/weight_sync_s": time.perf_counter() - t0}

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
        if self.transport is not None and self.transport is not self.disk:
            self.transport.close()
        if self.disk is not None:
            self.disk.close()


def _metrics(out: dict[str, float]) -> dict[str, float]:
    """The transport's metrics under the trainer's names (both transports report bytes)."""
    named = {"rollout/weight_sync_bytes": out.get("weight_sync/bytes", 0.0)}
    if "weight_sync/write_seconds" in out:
        named |= {"timing/weight_write_s": out["weight_sync/write_seconds"],
                  "timing/weight_update_s": out["weight_sync/load_seconds"]}
    return named | out
