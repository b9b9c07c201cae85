"""Deterministic held-out evaluation splits, disjoint from the training prompts.

A problem is identified by its text (``problem_key``). Two ways to hold problems out:

- by hash bucket (``heldout_fraction`` > 0): a problem whose key hashes below the fraction is an
  evaluation problem; the training set never contains one (generators reject it, datasets drop
  it). Deterministic across machines and runs (sha256, not Python's salted ``hash``).
- by rejection (``heldout_fraction`` = 0, generated tasks): evaluation problems are drawn from the
  generator with their own seed and every problem whose text is a training prompt is skipped. The
  training set is then exactly what it was without evaluation.

Either way ``heldout_prompts`` never returns a prompt whose text is also a training prompt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from typing import Any

from sao_megatron.envs.base import Prompt


def problem_key(prompt: Prompt) -> str:
    """The text that identifies a problem: ``meta['prompt']``, else the chat messages, else the ids."""
    meta = prompt.meta
    if isinstance(meta.get("prompt"), str):
        return meta["prompt"]
    if "messages" in meta:
        return json.dumps(meta["messages"], sort_keys=True)
    return json.dumps(prompt.input_ids)


def in_heldout_bucket(key: str, fraction: float) -> bool:
    """True for the keys of the held-out fraction (a fixed, seed-independent hash split)."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2.0 ** 64


def check_fraction(fraction: float) -> None:
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"data.options.heldout_fraction={fraction} must be in [0, 1) "
                         "(0: evaluation problems drawn apart from the training set; e.g. 0.1 holds out 10 %)")


def split_by_bucket(prompts: Iterable[Prompt], fraction: float) -> tuple[list[Prompt], list[Prompt]]:
    """(training, held-out); training prompts are renumbered 0..N-1 (the scheduler's indices)."""
    train, heldout = [], []
    for p in prompts:
        (heldout if in_heldout_bucket(problem_key(p), fraction) else train).append(p)
    renumbered = [Prompt(index=i, input_ids=p.input_ids, meta=p.meta) for i, p in enumerate(train)]
    return renumbered, heldout


def draw_heldout(draw: Callable[[int], Prompt], num: int, *, train_keys: set[str], fraction: float,
                 max_draws: int | None = None) -> list[Prompt]:
    """Up to ``num`` distinct held-out problems from ``draw(i)`` (a deterministic generator).

    With ``fraction`` > 0 a drawn problem is kept when it is in the held-out bucket, else when its
    text is not a training prompt; either way never a training prompt. Stops after ``max_draws``
    draws (default ``50 * num + 1000``): a small problem space may hold fewer than ``num``.
    """
    out: list[Prompt] = []
    seen: set[str] = set()
    for i in range(max_draws if max_draws is not None else 50 * num + 1000):
        if len(out) == num:
            break
        p = draw(i)
        key = problem_key(p)
        keep = in_heldout_bucket(key, fraction) if fraction > 0 else True
        if keep and key not in train_keys and key not in seen:
            seen.add(key)
            out.append(Prompt(index=len(out), input_ids=p.input_ids, meta=p.meta))
    return out


def require_heldout(found: list[Any], num: int, task: str, how_to_fix: str) -> list[Any]:
    """``found`` if non-empty, else a ValueError saying how to get evaluation problems."""
    if num > 0 and not found:
        raise ValueError(f"task {task!r} has no held-out problem disjoint from its training prompts; {how_to_fix}")
    return found
