"""The handoff between a transport and whoever pushes: a push staged, then delivered.

A transport's ``stage(owned, version)`` does, on the caller's (the trainer's main) thread, everything
that reads the actor's parameters or runs collectives over the training groups: the export's gathers,
the snapshot into host buffers, the disk write. It returns a :class:`Staged` push that delivers the
rest and never calls back: :meth:`Staged.deliver` (the engines take the weights; the caller holds the
pause around it on rank 0) and :meth:`Staged.finish` (after the pause: verification, pruning, metrics).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

Paused = Callable[[Callable[[], Awaitable[None]]], None]
"""Runs a delivery coroutine while generation is paused (rank 0's scheduler), blocking until it is done."""


class Staged(Protocol):
    """A push whose reading of the actor is done; what is left moves bytes to the engines."""

    version: int
    path: Path | None
    """The directory the engines load (the disk transport; what a restarted engine is given), else None."""
    reached: set[str] | None
    """After :meth:`finish` (rank 0): the engines the push reached, when the transport knows them."""

    async def deliver(self) -> None:
        """The engines take the weights (rank 0 with generation paused; a distributed push's other ranks
        send their buckets). May run on any thread: it touches no training group."""

    def finish(self) -> dict[str, float]:
        """After the pause: the transport's metrics (rank 0; ``{}`` elsewhere)."""


class NothingStaged:
    """What a rank holds whose transport is rank 0's alone (the disk push from an export gathered to rank 0)."""

    path = None
    reached = None

    def __init__(self, version: int):
        self.version = version

    async def deliver(self) -> None:
        return None

    def finish(self) -> dict[str, float]:
        return {}


def deliver_now(job: Staged, paused: Paused | None) -> dict[str, float]:
    """Deliver ``job`` on this thread, under ``paused`` when given (a transport's own ``push``)."""
    if paused is None:
        asyncio.run(job.deliver())
    else:
        paused(job.deliver)
    return job.finish()
