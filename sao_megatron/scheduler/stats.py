"""Rollout metrics: staleness of consumed samples, version lags per token, engine utilisation.

Per-batch quantities cover the samples consumed since the last ``report``; counters are
cumulative over the run (and survive ``state_dict``). Engine utilisation is the fraction of the
report window during which an engine had at least one /generate request open, measured from the
client side: the interval [send, reply] of every finished request and [send, now] of every request
still open (its engine read from the client's sticky routing), each clipped to the window. So a
request longer than a training step counts in every window it spans, not only the one it ends in.
Through an SGLang router the client cannot tell which engine serves a request: no utilisation is
reported then rather than a false zero.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sao_megatron.scheduler.sample import Sample

COUNTERS = ("admitted", "trained", "dropped_stale", "interrupted", "resumed", "discarded", "engine_retries",
            "failed", "reward_errors")


@dataclass(slots=True)
class RolloutStats:
    """Accumulators behind ``AsyncScheduler.metrics()``."""

    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    _batch: list[tuple[Sample, int]] = field(default_factory=list)
    _dropped: list[tuple[Sample, int]] = field(default_factory=list)
    _busy: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: collections.defaultdict(list))
    _window_start: float = field(default_factory=time.monotonic)
    _open: dict[str, float] = field(default_factory=dict)
    """Send time of every /generate request still open, by request id."""

    def add(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def observe_consumed(self, samples: list[Sample], version: int) -> None:
        self._batch.extend((s, version) for s in samples)

    def observe_dropped(self, samples: list[Sample], version: int) -> None:
        self._dropped.extend((s, version) for s in samples)

    def observe_request(self, url: str, start: float, end: float) -> None:
        self._busy[url].append((start, end))

    def request_opened(self, rid: str, start: float) -> None:
        self._open[rid] = start

    def request_closed(self, rid: str) -> None:
        self._open.pop(rid, None)

    def report(self, engine_urls: list[str], engine_of: Callable[[str], str | None] | None = None
               ) -> dict[str, float]:
        """``engine_of(rid)``: the engine an open request was sent to (None: unknown, not counted)."""
        now = time.monotonic()
        out = {f"rollout/{k}": float(v) for k, v in self.counters.items()}
        out.update(self._staleness())
        out.update(self._rewards())
        open_now: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        for rid, start in self._open.items():
            url = engine_of(rid) if engine_of is not None else None
            if url is not None:
                open_now[url].append((start, now))
        out.update(self._utilisation(engine_urls, self._window_start, now, open_now))
        self._busy.clear()
        out.update(stale_drop_by_length([s.num_action_tokens for s, _ in self._batch],
                                        [s.num_action_tokens for s, _ in self._dropped]))
        self._batch.clear()
        self._dropped.clear()
        self._window_start = now
        return out

    def _staleness(self) -> dict[str, float]:
        if not self._batch:
            return {}
        lags = [s.staleness(v) for s, v in self._batch]
        out = {"rollout/staleness_mean": sum(lags) / len(lags), "rollout/staleness_max": float(max(lags)),
               "rollout/batch_samples": float(len(lags)),
               "rollout/response_tokens_mean": sum(len(s.response_ids) for s, _ in self._batch) / len(lags),
               "rollout/interrupted_samples_frac": sum(s.num_interruptions > 0 for s, _ in self._batch) / len(lags)}
        for lag, n in collections.Counter(lags).items():
            out[f"rollout/staleness_hist/{lag}"] = float(n)
        token_lags = collections.Counter(v - tv for s, v in self._batch for tv in s.action_versions)
        total = sum(token_lags.values())
        for lag, n in token_lags.items():
            out[f"rollout/token_frac_lag/{lag}"] = n / total
        mixed = sum(len(set(s.action_versions)) > 1 for s, _ in self._batch)
        out["rollout/mixed_version_frac"] = mixed / len(lags)
        return out

    def _rewards(self) -> dict[str, float]:
        by_phase: dict[int, list[float]] = collections.defaultdict(list)
        for s, _ in self._batch:
            by_phase[s.phase].append(s.reward)
        out = {}
        for phase, rs in by_phase.items():
            mean = sum(rs) / len(rs)
            out[f"rollout/reward_mean/phase_{phase}"] = mean
            out[f"rollout/reward_max/phase_{phase}"] = max(rs)
            out[f"rollout/reward_std/phase_{phase}"] = (sum((r - mean) ** 2 for r in rs) / len(rs)) ** 0.5
        if self._batch:
            rewards = [s.reward for s, _ in self._batch]
            out["rollout/reward_mean"] = sum(rewards) / len(rewards)
            out["rollout/phase"] = float(max(s.phase for s, _ in self._batch))
            out["rollout/reward_error_frac"] = sum(s.reward_error is not None for s, _ in self._batch) / len(rewards)
        return out

    def _utilisation(self, urls: list[str], t0: float, t1: float,
                     open_now: dict[str, list[tuple[float, float]]]) -> dict[str, float]:
        if t1 <= t0 or not urls:
            return {}
        utils = []
        for url in urls:
            busy = self._busy.get(url, []) + open_now.get(url, [])
            utils.append(min(1.0, _union_length(busy, t0, t1) / (t1 - t0)))
        out = {f"rollout/engine_util/{i}": u for i, u in enumerate(utils)}
        out["rollout/engine_util_mean"] = sum(utils) / len(utils)
        out["rollout/engine_util_min"] = min(utils)
        return out


def _union_length(intervals: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Total length of the union of ``intervals`` clipped to [t0, t1]."""
    clipped = sorted((max(s, t0), min(e, t1)) for s, e in intervals if e > t0 and s < t1)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in clipped:
        if cur_e is None or s > cur_e:
            total += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (0.0 if cur_e is None else cur_e - cur_s)


def stale_drop_by_length(kept: list[int], dropped: list[int], *, num_bins: int = 4) -> dict[str, float]:
    """Stale-drop rate by response-length quantile: ``rollout/stale_drop_frac_q{1..num_bins}``.

    kept, dropped: the action-token counts of the finished samples trained on and dropped as stale.
    The bins are the quantiles of all of them together (q1 the shortest); a sample on a bin edge goes
    to the lower bin. ``frac_qk`` = dropped / finished in bin k (0 for an empty bin). Also
    ``rollout/stale_drop_frac`` overall and ``rollout/stale_drop_len_ratio``: mean length of the dropped
    over mean length of all finished samples (1: drops independent of length; >1: long ones starve;
    absent when nothing was dropped).
    """
    lengths = sorted(kept + dropped)
    if not lengths:
        return {}
    edges = [lengths[min(len(lengths) - 1, -(-k * len(lengths) // num_bins) - 1)] for k in range(1, num_bins)]
    total, lost = [0] * num_bins, [0] * num_bins
    for n, is_dropped in [(n, False) for n in kept] + [(n, True) for n in dropped]:
        k = sum(n > e for e in edges)
        total[k] += 1
        lost[k] += is_dropped
    out = {f"rollout/stale_drop_frac_q{k + 1}": lost[k] / total[k] if total[k] else 0.0 for k in range(num_bins)}
    mean_all = sum(lengths) / len(lengths)
    out["rollout/stale_drop_frac"] = len(dropped) / len(lengths)
    if dropped and mean_all:  # undefined without drops: absent rather than a 0 that reads "short ones dropped"
        out["rollout/stale_drop_len_ratio"] = (sum(dropped) / len(dropped)) / mean_all
    return out
