"""The sender's side of a pipelined distributed push (``weight_sync_distributed``): the reused buffers
buckets are flattened into, the small version-carrying last bucket, and the per-push phase timings."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from sao_megatron.rollout.update_group import flatten_bucket

NamedTensors = list[tuple[str, torch.Tensor]]

GLOO_PIPELINE_BYTES = 24 << 20
"""Bucket cap over gloo (CPU): ~10-15 ms on the wire, several times an update call's HTTP round trip.
Measured (``benchmarks/weight_sync.py --pipeline-mb 16 24 30 32 64 256``, docs/benchmarks.md): against
real SGLang on CPU 24-32 MB reach 0.42-0.54 of the floor where 16 MB reaches 0.27-0.37, and caps above
32 MB fall back (SGLang receives each bucket into a fresh buffer; above glibc's 32 MiB mmap ceiling every
such buffer is a fresh mapping that page-faults). 24 MB keeps every bucket clear of that ceiling."""


@dataclass(slots=True)
class Flat:
    """One bucket ready to send: its tensors and, for the flattened format, their bytes in one buffer."""

    bucket: NamedTensors
    nbytes: int
    buf: torch.Tensor | None
    slot: int | None
    """Which of the reused CPU send buffers ``buf`` is a view of (None: a buffer of its own, or none)."""


class SendBuffers:
    """``flatten_bucket``'s bytes, on CPU in one of two buffers reused by every push (a fresh buffer
    page-faults every 4 KiB: 30-50 ms of a 75 ms push of 44 MB). Bucket k is flattened into buffer
    k % 2 while bucket k-1 is on the wire from the other; the caller has waited for the send of
    bucket k-2 from it."""

    def __init__(self, device: torch.device, *, flattened: bool):
        self.device, self.flattened = device, flattened
        self.bufs = [torch.empty(0, dtype=torch.uint8) for _ in range(2)]

    def flatten(self, bucket: NamedTensors, k: int) -> Flat:
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        if not self.flattened:
            return Flat(bucket, nbytes, None, None)
        if self.device.type != "cpu":
            return Flat(bucket, nbytes, flatten_bucket([t for _, t in bucket]).to(self.device), None)
        slot = k % len(self.bufs)
        if self.bufs[slot].numel() < nbytes:
            self.bufs[slot] = torch.empty(0, dtype=torch.uint8)  # free the old one before allocating
            self.bufs[slot] = torch.empty(nbytes, dtype=torch.uint8)
        parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket]
        return Flat(bucket, nbytes, _pack(parts, self.bufs[slot][:nbytes]), slot)

    def drop(self, flat: Flat) -> None:
        """Never write into ``flat``'s buffer again (an abandoned send may still read it)."""
        if flat.slot is not None:
            self.bufs[flat.slot] = torch.empty(0, dtype=torch.uint8)


def _pack(parts: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """``parts`` (uint8, 1-D) back to back in ``out`` (uint8, [sum of their sizes]), wherever they live.

    ``torch.cat(out=)`` refuses parts on another device than ``out`` (CUDA weights over gloo with
    ``rollout.weight_sync.overlap=false``): those are copied one by one into their slices, each straight
    from the device into the buffer, so no part is staged twice.
    """
    if all(p.device == out.device for p in parts):
        return torch.cat(parts, out=out)
    offset = 0
    for p in parts:
        out[offset:offset + p.numel()].copy_(p)
        offset += p.numel()
    return out


def smallest_alone(bucket: NamedTensors, best: tuple[str, torch.Tensor] | None) -> tuple[str, torch.Tensor] | None:
    """The smaller of ``best`` and the bucket's smallest tensor that SGLang's loaders take on its own
    (loading it twice is harmless; a loader-group member alone would be dropped or break its pair)."""
    from sao_megatron.rollout.loader_groups import ANY_FAMILY, group_key

    for name, t in bucket:
        size = t.numel() * t.element_size()
        if (best is None or size < best[1].numel() * best[1].element_size()) and group_key(name, ANY_FAMILY) is None:
            best = (name, t)
    return best


@contextmanager
def timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Adds the block's wall time to ``phases[name]`` (the per-push breakdown in the metrics)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
