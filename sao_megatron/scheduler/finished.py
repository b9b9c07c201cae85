"""The scheduler's queue of finished units: the order they are consumed in and the staleness test.

A unit is the samples of one prompt (G in group mode, else 1), queued when its last episode
finishes. ``consume_order`` (docs/architecture.md#staleness) picks which unit a batch takes next:
``fifo`` (finish order), ``oldest_first`` (the unit with the oldest token version first, then
finish order), ``wait_oldest`` (oldest_first, and a batch also waits for in-flight episodes that
would be stale at the next batch). A unit is stale when any of its action tokens is older than
``v − η``; stale units are kept here, with the version they were dropped at, for the run's audit.
The queue only orders and judges: the scheduler does the accounting (re-queued prompts, counts).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from sao_megatron.scheduler.sample import Sample


class FinishedQueue:
    """Finished units waiting for the trainer, in finish order."""

    def __init__(self, consume_order: str, max_staleness: int) -> None:
        self.consume_order, self.max_staleness = consume_order, max_staleness
        self._units: deque[list[Sample]] = deque()
        self._versions: dict[int, int] = {}  # id(unit) -> its oldest version (a pass over its tokens)
        self._dropped: list[tuple[Sample, int]] = []  # (sample, version at which it was dropped)

    def __len__(self) -> int:
        return len(self._units)

    def __iter__(self) -> Iterator[list[Sample]]:
        return iter(self._units)

    def num_samples(self) -> int:
        return sum(len(u) for u in self._units)

    def append(self, unit: list[Sample]) -> None:
        self._units.append(unit)

    def put_back(self, units: list[list[Sample]]) -> None:
        """Return units taken by a batch that was cancelled, in their order, ahead of the rest."""
        self._units.extendleft(reversed(units))

    def unit_version(self, unit: list[Sample], version: int) -> int:
        """The unit's oldest action-token version (``version`` for a unit without actions),
        computed once per unit while it is queued (it reads every token)."""
        key = id(unit)
        if key not in self._versions:
            versions = [v for v in (s.oldest_version() for s in unit) if v is not None]
            self._versions[key] = min(versions) if versions else version
        return self._versions[key]

    def ready(self, missing: int, version: int, in_flight_versions: Iterable[int]) -> bool:
        """Whether a unit may be taken now. ``wait_oldest``: not while an in-flight episode that would be
        stale at the next batch (admitted at ``≤ v − η``) could still take one of the ``missing`` places."""
        if not self._units:
            return False
        if self.consume_order != "wait_oldest":
            return True
        at_risk = version - self.max_staleness
        if not any(v <= at_risk for v in in_flight_versions):
            return True
        return sum(len(u) for u in self._units if self.unit_version(u, version) <= at_risk) >= missing

    def pop(self, version: int) -> list[Sample]:
        """The next unit in ``consume_order``."""
        if self.consume_order == "fifo":
            return self._units.popleft()
        i = min(range(len(self._units)), key=lambda k: self.unit_version(self._units[k], version))  # oldest, first
        unit = self._units[i]
        del self._units[i]
        self._versions.pop(id(unit), None)
        return unit

    def is_stale(self, unit: list[Sample], version: int) -> bool:
        floor = version - self.max_staleness
        return any(s.oldest_version() is not None and s.oldest_version() < floor for s in unit)

    def record_dropped(self, unit: list[Sample], version: int) -> None:
        self._dropped.extend((s, version) for s in unit)

    def take_dropped(self) -> list[tuple[Sample, int]]:
        """The samples dropped since the last call, each with the version it was dropped at."""
        out, self._dropped = self._dropped, []
        return out

    def state(self) -> list[list[dict]]:
        return [[s.to_dict() for s in unit] for unit in self._units]

    def load(self, units: list[list[dict]]) -> None:
        self._units = deque([Sample.from_dict(d) for d in unit] for unit in units)
        self._versions.clear()
