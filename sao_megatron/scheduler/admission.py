"""The scheduler's admission budget: how many episodes may be started now (docs/architecture.md#staleness).

``num_started`` counts the episodes whose sample may still be trained on (trained + queued + in
flight). A unit of ``group_size`` episodes starts only if afterwards ``num_started ≤ (v + η + 1)·B``
(rebased by ``rebase``) and at most ``concurrency`` episodes are in flight; in ``sync`` mode only
up to the batch a waiting ``next_batch`` asked for. The scheduler keeps the counts up to date and
adds its own conditions (running, no fatal error, generation not paused).
"""

from __future__ import annotations

from sao_megatron.config.schema import SchedulerConfig


class AdmissionBudget:
    """The counts the admission rule reads, and the rule."""

    __slots__ = ("cfg", "group_size", "mode", "num_started", "in_flight", "base_started", "base_version",
                 "sync_request")

    def __init__(self, cfg: SchedulerConfig, *, group_size: int, mode: str, version: int) -> None:
        self.cfg, self.group_size, self.mode = cfg, group_size, mode
        self.num_started = self.in_flight = 0
        self.base_started, self.base_version = 0, version
        self.sync_request: int | None = None  # the batch size a waiting next_batch asked for (sync mode)

    def limit(self, version: int) -> int:
        """Largest ``num_started`` allowed at trainer version ``version``: ``(v + η + 1)·B``, rebased."""
        return self.base_started + (version - self.base_version + self.cfg.max_staleness + 1) * self.cfg.batch_size

    def allows_unit(self, version: int, trained: int) -> bool:
        """Whether one more unit (``group_size`` episodes) may start, ``trained`` samples consumed so far."""
        g = self.group_size
        if self.in_flight + g > self.cfg.concurrency:
            return False
        if self.mode == "sync":
            return self.sync_request is not None and self.num_started + g <= trained + self.sync_request
        return self.num_started + g <= self.limit(version)

    def started(self) -> None:
        """A unit was admitted."""
        self.num_started += self.group_size
        self.in_flight += self.group_size

    def rebase(self, trained: int, version: int) -> None:
        """Count admissions afresh from now (batches consumed without a policy update)."""
        self.base_started, self.base_version = trained, version
