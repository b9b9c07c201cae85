"""Run the asyncio rollout side on a background thread of the trainer's rank 0.

The training step is long, blocking torch work. If the scheduler shared the
main thread, no new episode would be admitted, no reward computed and no
finished request collected while the actor trains, and engines would go idle:
exactly the synchronous behaviour SAO removes. The event loop therefore runs
on its own thread and the trainer submits coroutines to it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class AsyncBridge:
    """An event loop on a daemon thread; ``run(coro)`` blocks the caller until it finishes."""

    def __init__(self, name: str = "rollout-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"rollout operation did not finish within {timeout} s") from None

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()
