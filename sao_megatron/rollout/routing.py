"""Built-in data routing: least-loaded engine, sticky per request id.

Used when no sglang-router is configured. A request id keeps going to the
engine that first served it (a resubmitted partial rollout lands where its
prefix may still be cached, and ``abort_request`` knows where to go); new ids
go to the healthy engine with the fewest requests in flight.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from sao_megatron.rollout.types import EngineUnavailable


class LeastLoadedRouter:
    """In-flight counting and rid stickiness over the engine URLs (engines come and go on restarts)."""

    def __init__(self, urls: list[str], *, max_sticky: int = 65536):
        if not urls:
            raise ValueError("no engine URLs: pass at least one engine URL (rollout.engine_urls)")
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate engine URLs in {urls}")
        self.urls = list(urls)
        self.inflight = {u: 0 for u in urls}
        self._healthy = set(urls)
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._max_sticky = max_sticky
        self._tiebreak = itertools.count()

    def healthy(self) -> list[str]:
        return [u for u in self.urls if u in self._healthy]

    def is_healthy(self, url: str) -> bool:
        return url in self._healthy

    def mark_unhealthy(self, url: str) -> None:
        self._healthy.discard(url)

    def mark_healthy(self, url: str) -> None:
        if url in self.inflight:
            self._healthy.add(url)

    def add(self, url: str) -> None:
        """A (re)started engine joins the rotation, healthy."""
        if url not in self.inflight:
            self.urls.append(url)
            self.inflight[url] = 0
        self._healthy.add(url)

    def remove(self, url: str) -> None:
        """An engine leaves for good (dead, being restarted); its open requests release quietly."""
        if url in self.inflight:
            self.urls.remove(url)
            del self.inflight[url]
        self._healthy.discard(url)

    def engine_of(self, rid: str) -> str | None:
        """The engine a request id was sent to (None if unknown or evicted)."""
        return self._sticky.get(rid)

    def pick(self, rid: str, exclude: frozenset[str] = frozenset(), avoid: frozenset[str] = frozenset()) -> str:
        """The engine for ``rid``: its sticky engine if healthy, else the least loaded healthy one.

        ``exclude``: never these; ``avoid``: these only when no other healthy engine is left (where an
        earlier try of the same turn failed: its resubmission goes elsewhere if it can)."""
        sticky = self._sticky.get(rid)
        if sticky is not None and sticky in self._healthy and sticky not in exclude | avoid:
            return sticky
        candidates = [u for u in self.urls if u in self._healthy and u not in exclude]
        candidates = [u for u in candidates if u not in avoid] or candidates
        if not candidates:
            raise EngineUnavailable(f"no healthy engine left among {self.urls} (unhealthy: "
                                    f"{sorted(set(self.urls) - self._healthy)})")
        # Rotate the starting point so ties spread over engines instead of piling on the first.
        start = next(self._tiebreak) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda u: self.inflight[u])

    def acquire(self, rid: str, url: str) -> None:
        self.inflight[url] += 1
        self._sticky[rid] = url
        self._sticky.move_to_end(rid)
        while len(self._sticky) > self._max_sticky:
            self._sticky.popitem(last=False)

    def release(self, url: str) -> None:
        if url in self.inflight:  # removed meanwhile (restarted): nothing to count
            self.inflight[url] -= 1
