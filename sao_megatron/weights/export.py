"""Stream a sharded Megatron model's weights under Hugging Face names, in bounded buckets.

Used by the HF exporter (``convert mcore-to-hf``) and by the weight sync to
the rollout engines. Every rank of the model's world must iterate the
generator to the end (it runs collectives); receivers get the buckets.

Per bucket: (1) the ranks holding the owner's shards gather each tensor of
the bucket (TP or expert-TP all-gather, SwiGLU fc1 re-interleaved); (2) each
owner ships its tensors, packed per dtype, to the receivers (point-to-point
to rank 0, or a broadcast to all); (3) receivers split the canonical Megatron
tensors into HF tensors (QKV de-grouped, [gate; up] split, vocab padding
trimmed) and yield ``[(hf_name, tensor), ...]``. The owner of a tensor is the
lowest global rank holding shard 0 of it, so data-parallel replicas never
gather or send twice. Memory per rank is bounded by ~one bucket.

    plan = ExportPlan(model_chunks, weight_map)          # collective, once per model
    for bucket in iter_hf_buckets(plan, receivers="rank0"):
        ...                                              # list of (hf_name, tensor)
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from sao_megatron.models.families.base import WeightMap
from sao_megatron.models.families.sharded import LocalTensor, check_coverage, gather_full, local_tensors

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ExportItem:
    """One canonical Megatron tensor of the global model."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    owner: int
    """Global rank that assembles the full tensor and sends it."""

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


class ExportPlan:
    """Who owns which tensor and how tensors are grouped into buckets (identical on every rank).

    Built once per model (one all_gather_object); reuse it for every export of that model.
    """

    def __init__(self, model_chunks: list[torch.nn.Module], wmap: WeightMap, *, bucket_bytes: int = 512 << 20):
        self.wmap = wmap
        self.rank = dist.get_rank()
        self.local: dict[str, LocalTensor] = {lt.name: lt for lt in local_tensors(model_chunks, wmap)}
        check_coverage(list(self.local.values()), wmap)
        self.items = self._items()
        self.buckets = _split(self.items, bucket_bytes)
        self.group_ranks = {name: _group_ranks(lt) for name, lt in self.local.items()}

    def _items(self) -> list[ExportItem]:
        mine = [(lt.name, lt.full_shape(), str(lt.tensor.dtype).removeprefix("torch."),
                 lt.group is None or dist.get_rank(lt.group) == 0) for lt in self.local.values()]
        gathered: list[list | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        owners: dict[str, tuple[int, tuple[int, ...], str]] = {}
        for rank, part in enumerate(gathered):
            for name, shape, dtype, first_shard in part or []:
                if first_shard and name not in owners:
                    owners[name] = (rank, tuple(shape), dtype)
        return [ExportItem(e.mcore, owners[e.mcore][1], getattr(torch, owners[e.mcore][2]), owners[e.mcore][0])
                for e in self.wmap.entries]

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self.items)


def _group_ranks(lt: LocalTensor) -> frozenset[int]:
    return frozenset(dist.get_process_group_ranks(lt.group)) if lt.group is not None else frozenset()


def _split(items: list[ExportItem], bucket_bytes: int) -> list[list[ExportItem]]:
    buckets: list[list[ExportItem]] = [[]]
    size = 0
    for item in items:
        if buckets[-1] and size + item.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(item)
        size += item.nbytes
    return [b for b in buckets if b]


@torch.no_grad()
def iter_hf_buckets(plan: ExportPlan, *, receivers: Literal["rank0", "all"] = "rank0",
                    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield buckets of (hf_name, full tensor) on the receivers; collective over the whole world.

    Tensors are in the model's dtype and on its device, and may be views of live parameters
    (when the receiver owns them unsharded): copy them before the next optimizer step if kept.
    """
    for bucket in plan.buckets:
        full = _assemble(plan, bucket)
        full = _ship(plan, bucket, full, receivers)
        if receivers == "all" or plan.rank == 0:
            yield [pair for item in bucket for pair in plan.wmap.to_hf(item.name, full[item.name])]


def iter_hf_tensors(plan: ExportPlan, *, receivers: Literal["rank0", "all"] = "rank0",
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Flattened :func:`iter_hf_buckets`."""
    for bucket in iter_hf_buckets(plan, receivers=receivers):
        yield from bucket


def _assemble(plan: ExportPlan, bucket: list[ExportItem]) -> dict[str, torch.Tensor]:
    """Full tensors of the bucket that this rank owns (gathers run only in the owner's shard group)."""
    full: dict[str, torch.Tensor] = {}
    for item in bucket:
        lt = plan.local.get(item.name)
        if lt is None:
            continue
        if lt.group is not None and item.owner in plan.group_ranks[item.name]:
            tensor = gather_full(lt)
        elif item.owner == plan.rank:
            tensor = lt.tensor.detach()
        else:
            continue
        if item.owner == plan.rank:
            full[item.name] = tensor
    return full


def _ship(plan: ExportPlan, bucket: list[ExportItem], full: dict[str, torch.Tensor],
          receivers: str) -> dict[str, torch.Tensor]:
    """Move the bucket's tensors from their owners to the receivers, one flat buffer per (owner, dtype)."""
    packs: dict[tuple[int, torch.dtype], list[ExportItem]] = {}
    for item in bucket:
        packs.setdefault((item.owner, item.dtype), []).append(item)
    device = next(iter(plan.local.values())).tensor.device
    out = dict(full)
    for (owner, dtype), items in sorted(packs.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        if receivers == "rank0" and (owner == 0 or plan.rank not in (0, owner)):
            continue
        numel = sum(torch.Size(i.shape).numel() for i in items)
        if plan.rank == owner:
            buf = torch.cat([full[i.name].reshape(-1) for i in items]) if len(items) > 1 else \
                full[items[0].name].reshape(-1).contiguous()
        else:
            buf = torch.empty(numel, dtype=dtype, device=device)
        if receivers == "all":
            dist.broadcast(buf, src=owner)
        elif plan.rank == owner:
            dist.send(buf, dst=0)
        else:
            dist.recv(buf, src=owner)
        if plan.rank != owner:
            for item, piece in zip(items, buf.split([torch.Size(i.shape).numel() for i in items])):
                out[item.name] = piece.view(item.shape)
    return out


def write_hf_weights(plan: ExportPlan, out_dir: str | pathlib.Path, *, dtype: torch.dtype | None = None,
                     max_shard_bytes: int = 5 << 30, progress: bool = False) -> int:
    """Write the model as HF safetensors shards + index into the existing ``out_dir`` (rank 0 writes).

    Collective. ``dtype``: on-disk dtype (default: the model's), except the family's fp32 tensors.
    Writes weights only (add config.json / tokenizer files beside them). Returns bytes written (0 off rank 0).
    """
    from tqdm import tqdm

    from sao_megatron.models.families.hf_files import write_sharded

    stream = iter_hf_tensors(plan, receivers="rank0")
    if plan.rank != 0:
        for _ in stream:  # non-receivers still take part in every collective
            pass
        return 0
    stream = tqdm(stream, total=len(plan.wmap.hf_names()), desc="megatron -> hf", unit="tensor",
                  disable=not progress)

    def dtype_of(name: str) -> torch.dtype | None:
        return torch.float32 if plan.wmap.is_fp32(name) else dtype

    return write_sharded(stream, pathlib.Path(out_dir), max_shard_bytes=max_shard_bytes, dtype_of=dtype_of)


# ---------------------------------------------------------------------------------------- weight sync
@torch.no_grad()
def iter_owned_hf_tensors(plan: ExportPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's share of the export under HF names: every canonical tensor it owns, full.

    TP / expert-TP shards are gathered inside their own group (collective there only);
    nothing crosses to rank 0, so each owner (PP stage, EP rank with global expert ids)
    can send its own tensors (``rollout.weight_sync.transport``). Every rank must iterate to the end.
    Tensors may be views of live parameters: send or copy them before the next step.
    """
    for bucket in plan.buckets:
        full = _assemble(plan, bucket)
        for item in bucket:
            if item.owner == plan.rank:
                yield from plan.wmap.to_hf(item.name, full[item.name])


def owns_tensors(plan: ExportPlan) -> bool:
    """Whether this rank sends anything in :func:`iter_owned_hf_tensors` (a weight-sync sender)."""
    return any(item.owner == plan.rank for item in plan.items)


def export_weights(plan: ExportPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective generator: the actor's weights as (HF name, full tensor) on rank 0 (nothing
    elsewhere). Every rank must exhaust it (``drain`` on the others) to keep collectives in step."""
    return iter_hf_tensors(plan, receivers="rank0")


def drain(gen: Iterator[object]) -> None:
    """Exhaust a collective generator (this rank's side of an export it does not consume)."""
    for _ in gen:
        pass
