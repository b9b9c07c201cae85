"""Dynamic micro-batching by token budget.

Long-tail response lengths make fixed-size micro-batches waste most of their
compute on padding. Samples are sorted by length and packed greedily so that
each micro-batch's *padded* size (rows × longest row, rounded up to the
sequence-parallel multiple) stays within ``max_tokens``. On CPU/local specs
Megatron has no packed-sequence (THD) attention, so padded micro-batches with
similar lengths are the no-waste option that works on both CPU and GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(kw_only=True, slots=True)
class MicroBatchPlan:
    """Indices of the samples in each micro-batch and its padded length."""

    indices: list[list[int]]
    """Sample indices (into the batch) per micro-batch."""
    seq_lengths: list[int]
    """Padded sequence length per micro-batch (a multiple of ``pad_multiple``)."""

    @property
    def num_padded_tokens(self) -> int:
        return sum(len(ix) * s for ix, s in zip(self.indices, self.seq_lengths))


def round_up(n: int, multiple: int) -> int:
    return int(math.ceil(n / multiple) * multiple)


def plan_microbatches(lengths: list[int], *, max_tokens: int, pad_multiple: int = 1,
                      num_microbatches_multiple: int = 1) -> MicroBatchPlan:
    """Greedy first-fit over samples sorted by decreasing length.

    A sample longer than ``max_tokens`` gets a micro-batch of its own (never
    dropped). ``num_microbatches_multiple`` lets pipeline schedules ask for a
    count divisible by e.g. the PP size (empty groups are never produced: the
    largest micro-batches are split instead).
    """
    if not lengths:
        return MicroBatchPlan(indices=[], seq_lengths=[])
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        # Sorted descending: the first sample of a group fixes its padded length.
        if groups and (len(groups[-1]) + 1) * round_up(lengths[groups[-1][0]], pad_multiple) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    while len(groups) % num_microbatches_multiple and any(len(g) > 1 for g in groups):
        biggest = max(range(len(groups)), key=lambda k: len(groups[k]))
        g = groups.pop(biggest)
        groups[biggest:biggest] = [g[: len(g) // 2], g[len(g) // 2:]]
    seq = [round_up(max(lengths[i] for i in g), pad_multiple) for g in groups]
    return MicroBatchPlan(indices=groups, seq_lengths=seq)


def slice_padded(tensors: dict[str, torch.Tensor], indices: list[int], seq_length: int) -> dict[str, torch.Tensor]:
    """Select rows ``indices`` of every [B, T] tensor and cut/pad columns to ``seq_length``.

    Padding uses zeros, which is neutral for masks, rewards and log-probs; token
    padding with 0 is harmless because attention is causal and padded positions
    are masked out of every loss.
    """
    out = {}
    for name, t in tensors.items():
        rows = t[indices]
        if rows.dim() >= 2:
            if rows.shape[1] >= seq_length:
                rows = rows[:, :seq_length]
            else:
                pad = rows.new_zeros((rows.shape[0], seq_length - rows.shape[1], *rows.shape[2:]))
                rows = torch.cat([rows, pad], dim=1)
        out[name] = rows.contiguous()
    return out
