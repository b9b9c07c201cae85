"""SGLang's named weight-update groups, both ends (sglang 0.5.23 ``srt/utils/common.py``).

A group is a process group outside any default world: a TCP rendezvous at
``master_address:master_port`` hosted by group rank 0 (the sender), keys under
``PrefixStore(group_name)`` so several groups can share one store port space,
ranks fixed to ``0..world_size-1``. SGLang's engine ranks join as
``rank_offset + tp_rank``. The timeout bounds every rendezvous and collective
of the group, so a peer that dies cannot hang the other side for longer.
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import torch

# Buckets of the flattened format are one uint8 buffer; each tensor must start at a
# multiple of its dtype's size (SGLang's FlattenedTensorBucket.empty refuses others).
FLATTENED_BUCKET = "flattened_bucket"


def init_custom_process_group(*, backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                              group_name: str, timeout: timedelta = timedelta(minutes=10)):
    """Join (rank 0: host) the named group; returns the process group. Blocks until all ranks joined."""
    from torch.distributed import distributed_c10d as c10d

    store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                   timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                              group_name=group_name, timeout=timeout, **{options: None})
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16`` (SGLang's ``getattr(torch, dtype)``); ValueError otherwise."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}: use a torch dtype name such as 'bfloat16'")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def flatten_bucket(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One uint8 buffer of the tensors' bytes, back to back (SGLang's FlattenedTensorBucket layout)."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def bucket_layout(dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[tuple[int, int]]:
    """(start, end) byte offsets of each tensor in a flattened bucket; ValueError as SGLang refuses."""
    offsets, offset = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        if offset % dtype.itemsize:
            raise ValueError(f"unaligned tensor: byte offset {offset}, dtype {dtype}")
        size = torch.Size(shape).numel() * dtype.itemsize
        offsets.append((offset, offset + size))
        offset += size
    if not offsets:
        raise ValueError("cannot receive an empty bucket")
    return offsets


def unflatten_bucket(buf: torch.Tensor, dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    """Views of ``buf`` (uint8) as the bucket's tensors."""
    return [buf[a:b].view(dtype).reshape(shape)
            for (a, b), dtype, shape in zip(bucket_layout(dtypes, shapes), dtypes, shapes)]
