"""Push trainer weights (HF names, full tensors) to the rollout engines.

Two transports, both called by the scheduler while generation is paused:
- ``DiskWeightSync``: sharded safetensors + index in ``sync_root/v{version}``,
  written atomically, then ``update_weights_from_disk`` on every engine. Simple
  and robust; the only path the embedded CPU engine supports.
- ``NcclWeightSync``: the trainer's rank 0 and every engine GPU join one
  broadcast group; weights go in buckets (``update_weights_from_distributed``
  announces names/dtypes/shapes while rank 0 broadcasts the tensors in the same
  order). Bucketing is plain logic, tested on CPU; the group itself works with
  gloo (tested on CPU) and NCCL (GPU only).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

from sao_megatron.rollout.client import RolloutClient

logger = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, torch.Tensor]]
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def _copy_template(template_dir: Path, out: Path) -> None:
    """Every non-weight file of an HF dir (config, generation config, tokenizer files)."""
    for src in template_dir.iterdir():
        if src.is_file() and not src.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(src, out / src.name)


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def _shards(named_tensors: NamedTensors, max_shard_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Group tensors (CPU, contiguous, unaliased) into shards of at most ``max_shard_bytes``."""
    shard: dict[str, torch.Tensor] = {}
    size = 0
    seen: set[str] = set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name} given twice")
        seen.add(name)
        t = tensor.detach().to("cpu").contiguous().clone()  # clone: safetensors refuses shared storage
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = t
        size += nbytes
    if shard:
        yield shard


def write_hf_safetensors(named_tensors: NamedTensors, out_dir: str | Path, *, template_dir: str | Path | None = None,
                         max_shard_bytes: int = 4 << 30) -> Path:
    """Write an HF checkpoint directory atomically; returns ``out_dir``.

    Shards are ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``
    (a single shard is ``model.safetensors``). Everything is written in a temporary
    sibling directory then renamed, so readers never see a half-written checkpoint;
    an existing ``out_dir`` is replaced.
    """
    out_dir = Path(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        files, weight_map, total = [], {}, 0
        for i, shard in enumerate(_shards(named_tensors, max_shard_bytes)):
            name = f"shard-{i:05d}.safetensors"
            _save_shard(shard, tmp / name)
            files.append(name)
            for key, t in shard.items():
                weight_map[key] = name
                total += t.numel() * t.element_size()
        if not files:
            raise ValueError("no tensors to write")
        final = _final_names(len(files))
        for old, new in zip(files, final):
            os.replace(tmp / old, tmp / new)
        if len(final) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {k: final[files.index(v)] for k, v in sorted(weight_map.items())}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if template_dir is not None:
            _copy_template(Path(template_dir), tmp)
        _atomic_replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _final_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _atomic_replace_dir(src: Path, dst: Path) -> None:
    if not dst.exists():
        os.replace(src, dst)
        return
    trash = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(dst, trash)
    os.replace(src, dst)
    shutil.rmtree(trash, ignore_errors=True)


class DiskWeightSync:
    """safetensors on a shared file system + ``update_weights_from_disk`` on every engine."""

    def __init__(self, client: RolloutClient, sync_root: str | Path, *, keep_last: int = 2,
                 max_shard_bytes: int = 4 << 30):
        self.client = client
        self.sync_root = Path(sync_root)
        self.keep_last = max(1, keep_last)
        self.max_shard_bytes = max_shard_bytes

    async def push(self, named_tensors: NamedTensors, version: int, template_dir: str | Path) -> dict[str, float]:
        """Write version ``version`` and make every engine load it (the caller pauses generation first)."""
        start = time.perf_counter()
        path = self.sync_root / f"v{version:06d}"
        await asyncio.to_thread(write_hf_safetensors, named_tensors, path, template_dir=template_dir,
                                max_shard_bytes=self.max_shard_bytes)
        written = time.perf_counter()
        await self.client.begin_weight_update()
        try:
            await self.client.update_weights_from_disk(str(path), weight_version=version)
        finally:
            await self.client.end_weight_update()
        self._prune()
        nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        return {"weight_sync/bytes": float(nbytes), "weight_sync/seconds": time.perf_counter() - start,
                "weight_sync/write_seconds": written - start, "weight_sync/load_seconds": time.perf_counter() - written}

    def _prune(self) -> None:
        versions = sorted(p for p in self.sync_root.glob("v[0-9]*") if p.is_dir())
        for old in versions[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------- NCCL path
@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What an engine needs to receive one tensor: its name, dtype (torch name) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorMeta:
        return cls(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
                   tensor.numel() * tensor.element_size())


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Consecutive groups of at most ``bucket_bytes`` (a larger tensor travels alone), order kept."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[TensorMeta]] = []
    size = 0
    for meta in metas:
        if not buckets or size + meta.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(meta)
        size += meta.nbytes
    return buckets


def init_custom_process_group(*, backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                              group_name: str, timeout: timedelta = timedelta(minutes=10)):
    """A process group outside the default world (trainer rank 0 + engines), as SGLang builds its side.

    Same store layout as sglang's ``init_custom_process_group``: a TCP rendezvous at
    ``master_address:master_port`` (rank 0 hosts it), keys under ``PrefixStore(group_name)``.
    """
    import inspect

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


class NcclWeightSync:
    """Bucketed broadcast from the trainer's rank 0 to every engine (``update_weights_from_distributed``)."""

    def __init__(self, client: RolloutClient, *, master_address: str, master_port: int,
                 bucket_bytes: int = 512 << 20, group_name: str = "weight_update_group", backend: str = "nccl",
                 device: str | torch.device | None = None):
        self.client = client
        self.master_address, self.master_port = master_address, master_port
        self.bucket_bytes = bucket_bytes
        self.group_name = group_name
        self.backend = backend
        self.device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
        self.group = None

    async def connect(self, engine_world_sizes: list[int] | None = None) -> int:
        """Engines and this process join the group concurrently (the rendezvous needs everyone)."""
        if engine_world_sizes is None:
            engine_world_sizes = await self.client.engine_world_sizes()
        world_size = 1 + sum(engine_world_sizes)
        engines = asyncio.create_task(self.client.init_weights_update_group(
            self.master_address, self.master_port, engine_world_sizes=engine_world_sizes,
            group_name=self.group_name, backend=self.backend))
        self.group = await asyncio.to_thread(
            init_custom_process_group, backend=self.backend, master_address=self.master_address,
            master_port=self.master_port, world_size=world_size, rank=0, group_name=self.group_name)
        await engines
        return world_size

    async def push(self, named_tensors: NamedTensors, version: int) -> dict[str, float]:
        """Stream buckets; only the last one carries the version and flushes the cache."""
        if self.group is None:
            raise RuntimeError("NcclWeightSync.push before connect()")
        start, nbytes, num_buckets = time.perf_counter(), 0, 0
        pending: list[tuple[TensorMeta, torch.Tensor]] = []
        size = 0
        for name, tensor in named_tensors:
            meta = TensorMeta.of(name, tensor)
            if pending and size + meta.nbytes > self.bucket_bytes:
                await self._send_bucket(pending, None)
                num_buckets, pending, size = num_buckets + 1, [], 0
            pending.append((meta, tensor))
            size += meta.nbytes
            nbytes += meta.nbytes
        if pending:
            await self._send_bucket(pending, version)
            num_buckets += 1
        return {"weight_sync/bytes": float(nbytes), "weight_sync/seconds": time.perf_counter() - start,
                "weight_sync/buckets": float(num_buckets)}

    async def _send_bucket(self, bucket: list[tuple[TensorMeta, torch.Tensor]], version: int | None) -> None:
        metas = [m for m, _ in bucket]
        announce = asyncio.create_task(self.client.update_weights_from_distributed(
            [m.name for m in metas], [m.dtype for m in metas], [list(m.shape) for m in metas],
            group_name=self.group_name, weight_version=version, flush_cache=version is not None))
        await asyncio.to_thread(self._broadcast, [t for _, t in bucket])
        await announce

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        for t in tensors:
            dist.broadcast(t.detach().to(self.device).contiguous(), src=0, group=self.group)

    async def close(self) -> None:
        import torch.distributed as dist

        if self.group is not None:
            await self.client.destroy_weights_update_group(self.group_name)
            dist.destroy_process_group(self.group)
            self.group = None
