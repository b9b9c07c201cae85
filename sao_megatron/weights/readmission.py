"""Trainer-side glue of engine restarts (``rollout.supervisor``): which weights a restarted engine
must serve, how it gets them, and how locally started engines are restarted.

- :class:`CurrentWeights`: the newest exported HF directory and its version, with the lock that
  every weight push holds (``weights.publisher.WeightPublisher``), so an engine is loaded and
  admitted either wholly before a push (the push then reaches it too) or after it (it loads the
  new weights). It is the one record of the served version: the publisher writes it, the client,
  the scheduler and the supervisor's readmission read it.
- Disk sync (``disk_readmit``): the restarted engine loads that directory, then is admitted.
- Distributed sync (:class:`PendingReconnects`): the trainer reconnects the engine's update groups
  at the next step boundary (collective on every rank), pushes, and admits it when the push reached it.
- Embedded engines (:class:`LocalRestarter`): restart from a hard-linked snapshot of the current
  weights (the export directory may be pruned while the engine loads it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from sao_megatron.rollout.launch import LocalEngines
from sao_megatron.rollout.supervisor import Admit
from sao_megatron.rollout.types import EngineError

logger = logging.getLogger(__name__)


class CurrentWeights:
    """The HF directory and version every admitted engine serves."""

    def __init__(self, path: str | Path | None, version: int):
        self.path, self.version = (Path(path) if path is not None else None), int(version)
        self.pending: int | None = None
        """The version a push in flight is loading (engines may already report it), else None."""
        self.lock = asyncio.Lock()
        """Held by every weight push and by every admission."""

    def set(self, path: str | Path | None, version: int) -> None:
        if path is not None:
            self.path = Path(path)
        self.version = int(version)

    async def snapshot(self, dest: Path) -> tuple[Path, int]:
        """Hard links of the current directory under ``dest`` (replaced), and its version."""
        async with self.lock:
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir(parents=True)
            for f in self.path.iterdir():
                if f.is_file():
                    try:
                        os.link(f, dest / f.name)
                    except OSError:  # another file system: copy
                        shutil.copy2(f, dest / f.name)
            return dest, self.version


async def served_version(client, url: str) -> str | None:
    try:
        return str((await client.engine_model_info(url)).get("weight_version"))
    except EngineError:
        return None


def disk_readmit(client, weights: CurrentWeights, on_admit: Callable[[str, str], None] = lambda old, new: None):
    """Readmission for rollout.weight_sync.transport=disk: load the current directory unless already served.
    ``on_admit(old, new)`` after the admission (e.g. ``DiskWeightSync.reconnect``: verify the next push)."""
    async def readmit(old: str, new: str, admit: Admit) -> None:
        async with weights.lock:
            if await served_version(client, new) != str(weights.version):
                await client.load_weights_from_disk_on(new, str(weights.path), weight_version=weights.version)
            await admit(new)
        on_admit(old, new)
    return readmit


class PendingReconnects:
    """Readmission for rollout.weight_sync.transport=distributed: queued until the trainer's next push."""

    def __init__(self):
        self._pending: list[tuple[str, str, Admit]] = []

    async def readmit(self, old: str, new: str, admit: Admit) -> None:
        self._pending.append((old, new, admit))

    def take(self) -> list[tuple[str, str, Admit]]:
        """The engines to reconnect before the next push (the queue empties)."""
        out, self._pending = self._pending, []
        return out


class LocalRestarter:
    """``EngineLauncher`` over :class:`LocalEngines`: restart from a snapshot of the current weights.

    ``restart`` blocks (the supervisor runs it in a thread); ``loop`` is the loop the weights lock lives on."""

    def __init__(self, engines: LocalEngines, weights: CurrentWeights, loop: asyncio.AbstractEventLoop,
                 snapshot_root: Path, extra_args: list[str]):
        self.engines, self.weights, self.loop = engines, weights, loop
        self.snapshot_root, self.extra_args = snapshot_root, extra_args
        self._count = itertools.count()

    def alive(self, index: int) -> bool:
        return self.engines.alive(index)

    def restart(self, index: int) -> str:
        dest = self.snapshot_root / f"engine{index}"
        path, version = asyncio.run_coroutine_threadsafe(self.weights.snapshot(dest), self.loop).result()
        logger.warning("restarting engine %d from %s (version %d)", index, path, version)
        return self.engines.restart(index, model_dir=path,
                                    extra_args=["--weight-version", str(version), *self.extra_args])
