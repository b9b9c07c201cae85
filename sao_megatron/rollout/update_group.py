"""SGLang's named weight-update groups, both ends (sglang 0.5.23 ``srt/utils/common.py``).

A group is a process group outside any default world: a TCP store at
``master_address:master_port`` hosted by group rank 0 (the sender), keys under
``PrefixStore(group_name)`` so several groups can share one store port space,
ranks fixed to ``0..world_size-1``. SGLang's engine ranks join as
``rank_offset + tp_rank``. The timeout bounds every rendezvous and collective
of the group, so a peer that dies cannot hang the other side for longer.

SGLang's receivers reach the store through ``c10d.rendezvous("tcp://…")``; this side
builds the same ``TCPStore`` itself (see :func:`group_store` for why), so both ends
speak one store protocol and one key layout.
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

    store = c10d.PrefixStore(group_name, group_store(master_address, master_port, world_size, rank, timeout))
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                              group_name=group_name, timeout=timeout, **{options: None})
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def group_store(master_address: str, master_port: int, world_size: int, rank: int, timeout: timedelta):
    """The group's TCP store: rank 0 serves it at ``master_address:master_port``, the others dial it.

    Built directly, not through ``c10d.rendezvous("tcp://…")``: under torchrun
    (``TORCHELASTIC_USE_AGENT_STORE=True``) torch ≤ 2.11's tcp handler makes *every* rank a client of
    the elastic agent's store whatever the address, so the sender would wait for a server nobody runs
    (torch 2.14 honours the flag only at the agent's own ``MASTER_ADDR:MASTER_PORT``). The arguments are
    the handler's own for a non-agent store (``multi_tenant``: several stores of one process may share
    the port), so a receiver that comes in through the handler dials exactly this server.
    """
    from torch.distributed import TCPStore

    if not 0 < master_port < 2**16:
        raise ValueError(f"update group port {master_port} is not a TCP port: pass one in 1..65535")
    return TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                    multi_tenant=True)


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
