"""A push's checksum verification: the engines' ``/weights_checker`` against what the senders hashed.

Both transports compare this way after a push (the first of a layout, and on demand); the checksums
themselves, and how an engine holds the weights, are the wire's (``rollout.weight_check``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx

from sao_megatron.errors import SaoError
from sao_megatron.rollout.weight_check import EngineHolding, compare_checksums

logger = logging.getLogger(__name__)


class WeightSyncError(SaoError):
    """The weights could not be delivered to any engine, or an engine cannot take part in the sync."""



@dataclass(frozen=True, slots=True)
class Unverified:
    """What a push's verification could not check."""

    engines: int
    """Engines whose checksums were not compared at all (CUDA, tp > 1, FP8, no /weights_checker)."""
    tensors: int
    """On the engines that were compared, the most exported tensors one of them left unchecked: parts of a
    fused parameter whose other parts were exported elsewhere (another rank, another disk shard), so the
    fused checksum cannot be formed, and (``weight_sync_strict_names`` off) names the engine does not
    report."""

    def metrics(self) -> dict[str, float]:
        """``verified``: every engine reached had its checksums compared (and none differed);
        ``unverified_tensors`` says how much of the export that comparison could not cover."""
        return {"weight_sync/verified": float(not self.engines),
                "weight_sync/unverified_engines": float(self.engines),
                "weight_sync/unverified_tensors": float(self.tensors)}


def verify_engines(http: httpx.Client, engines: list[tuple[str, EngineHolding]],
                   expected: dict[EngineHolding, dict[str, str]], *, strict: bool) -> Unverified:
    """Compare the checksums of every engine whose holding can be reproduced (WeightMismatchError on a
    difference); count what could not be compared, and say so once per push."""
    engines_left, tensors_left = 0, 0
    for url, holding in engines:
        if holding.unverifiable:
            logger.warning("%s: weights not verified (%s); the log-prob parity gate covers it", url,
                           holding.unverifiable)
            engines_left += 1
            continue
        sums = expected.get(holding, {})
        compared = check_engine(http, url, sums, strict=strict)
        if not compared:
            engines_left += 1
        elif compared < len(sums):
            tensors_left = max(tensors_left, len(sums) - compared)
    if tensors_left:
        logger.warning("weight verification left %d exported tensors unchecked (parts of fused parameters "
                       "split over export shards or ranks; see docs/weight-publishing.md#verification)",
                       tensors_left)
    return Unverified(engines_left, tensors_left)


def check_engine(http: httpx.Client, url: str, expected: dict[str, str], *, strict: bool) -> int:
    """Compare one engine's ``/weights_checker`` checksums with ``expected`` (as the engine holds the
    weights: ``weight_check.EngineHolding``); returns tensors compared. WeightMismatchError on a
    difference. 0 (not verified, with a warning) when the engine reports several ranks (shards) or
    no tensor named alike on both sides.
    """
    try:
        reply = http.post(url.rstrip("/") + "/weights_checker", json={"action": "checksum"}).json()
    except (httpx.HTTPError, ValueError) as exc:
        raise WeightSyncError(f"{url}/weights_checker failed: {exc}") from None
    if not reply.get("success"):
        raise WeightSyncError(f"{url}/weights_checker failed: {reply.get('message')}")
    ranks = reply.get("ranks") or []
    if len(ranks) != 1 or any(int(i["tp_size"]) > 1 for i in ranks[0]["parallelism_info"]):
        logger.warning("%s reports checksums of %d ranks (shards): not comparable with full tensors; not "
                       "verified", url, len(ranks))
        return 0
    compared = compare_checksums(expected, ranks[0]["checksums"], where=f"engine {url}", require_all=strict)
    if not compared:
        logger.warning("%s: no tensor named alike on both sides; weights not verified", url)
    return compared
