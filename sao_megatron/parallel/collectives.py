"""Small rank-0-centred collectives of the trainer (objects, status, metrics)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from sao_megatron.errors import SaoError

T = TypeVar("T")


class RemoteRankError(SaoError):
    """Raised on the other ranks when rank 0 failed; carries rank 0's message."""


def broadcast_object(obj: Any, group: dist.ProcessGroup | None = None) -> Any:
    """``group``'s rank 0's ``obj`` on every rank of ``group`` (None: the whole world)."""
    box = [obj if dist.get_rank(group) == 0 else None]
    src = dist.get_global_rank(group, 0) if group is not None else 0  # broadcast_object_list takes a global rank
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def first_error(error: BaseException | None, group: dist.ProcessGroup | None = None) -> str | None:
    """Collective: share whether each rank failed, so every rank learns of a failure at once instead of
    the others blocking in the next collective until its timeout. ``error``: this rank's failure (None:
    it succeeded); returns the lowest failed rank's ``"Type: message"`` on every rank, None when none failed."""
    errors: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}", group=group)
    return next((e for e in errors if e), None)


def rank0_call(fn: Callable[[], T], *, others: Callable[[], None] | None = None) -> T | None:
    """Run ``fn`` on rank 0 (``others`` elsewhere, e.g. their side of a collective), then share
    success or failure, so a bad input seen by rank 0 stops every rank at once instead of
    leaving them blocked in the next collective until the timeout."""
    result, error = None, None
    try:
        if dist.get_rank() == 0:
            result = fn()
        elif others is not None:
            others()
    except Exception as exc:  # shared below, then re-raised
        error = exc
    first = first_error(error)
    if error is not None:
        raise error
    if first:
        raise RemoteRankError(f"another rank failed: {first}")
    return result


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is True on any rank."""
    box = [None] * dist.get_world_size()
    dist.all_gather_object(box, bool(flag))
    return any(box)


def combine_metrics(parts: list[tuple[dict[str, Any], float]]) -> dict[str, float]:
    """Combine per-part metrics (micro-batches, ranks), each with its weight (action tokens).

    Keys ending in ``max``/``min`` take the max/min; ``_loss`` (a share of a global objective),
    ``_sum``, ``count`` and ``num_action_tokens`` are summed; everything else is the weighted mean.
    Non-numeric values are dropped; a part without a key does not dilute it.
    """
    out: dict[str, float] = {}
    for key in sorted({k for m, _ in parts for k in m}):
        vals = [(float(m[key]), w) for m, w in parts if key in m and _is_number(m[key])]
        if not vals:
            continue
        if key.endswith("max"):
            out[key] = max(v for v, _ in vals)
        elif key.endswith("min"):
            out[key] = min(v for v, _ in vals)
        elif key.endswith(("_loss", "_sum", "count", "num_action_tokens")):
            out[key] = sum(v for v, _ in vals)
        else:
            total = sum(w for _, w in vals)
            out[key] = sum(v * w for v, w in vals) / total if total > 0 else math.nan
    return out


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) or (hasattr(x, "numel") and x.numel() == 1)


def gather_metrics(local: dict[str, float], weight: float) -> dict[str, float]:
    """Per-rank metrics combined on rank 0 by ``combine_metrics`` ({} elsewhere). Ranks that hold no
    metrics pass ``{}`` (e.g. non-last pipeline stages, TP ranks other than 0)."""
    box: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(box, (local, weight))
    return combine_metrics(box) if dist.get_rank() == 0 else {}
