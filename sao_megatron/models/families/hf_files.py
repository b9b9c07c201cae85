"""Lazy, validated access to HF safetensors checkpoints (read) and sharded writing (write).

Reading never loads a whole checkpoint: tensors come one at a time from the
memory-mapped shards (``safe_open``), which also works for transformers-5
models because files on disk keep per-expert names. All shards are opened
(headers checked) up front so a missing or truncated shard is reported
before anything is converted or written.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from sao_megatron.models.families.base import ConversionError, Family, WeightMap

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HfCheckpoint:
    """Read-only view of ``hf_dir``'s safetensors (single file, or index + shards)."""

    def __init__(self, hf_dir: str | pathlib.Path):
        self.dir = pathlib.Path(hf_dir)
        self._keys: dict[str, set[str]] = {}
        self.weight_map = self._read_weight_map()
        self._files = {name: self._open(name) for name in sorted(set(self.weight_map.values()))}
        for key, name in self.weight_map.items():
            if key not in self._keys[name]:
                raise ConversionError(f"{self.dir / INDEX}: lists '{key}' in {name}, but that shard lacks it")

    def _read_weight_map(self) -> dict[str, str]:
        index = self.dir / INDEX
        if index.is_file():
            try:
                return dict(json.loads(index.read_text())["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ConversionError(f"{index}: not a valid safetensors index ({exc})") from exc
        if (self.dir / SINGLE).is_file():
            return dict.fromkeys(sorted(self._open(SINGLE).keys()), SINGLE)
        raise ConversionError(f"{self.dir}: no {SINGLE} or {INDEX}; only safetensors checkpoints are supported")

    def _open(self, name: str):
        path = self.dir / name
        if not path.is_file():
            raise ConversionError(f"{path}: shard listed in {INDEX} is missing")
        try:
            handle = safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise ConversionError(f"{path}: truncated or not a safetensors file ({exc})") from exc
        self._keys[name] = set(handle.keys())
        return handle

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._files[self.weight_map[name]].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        """One tensor, read from its shard (copy-on-read from the memory map)."""
        if name not in self.weight_map:
            raise ConversionError(f"{self.dir}: tensor '{name}' not found in the checkpoint")
        return self._files[self.weight_map[name]].get_tensor(name)

    def validate(self, family: Family, wmap: WeightMap) -> None:
        """ConversionError unless the files hold exactly the tensors (and shapes) the config implies."""
        expected = wmap.hf_shapes()
        have = {k for k in self.weight_map if not family.is_ignored_hf(k, wmap.cfg)}
        missing, extra = [k for k in expected if k not in have], sorted(have - set(expected))
        if missing or extra:
            raise ConversionError(
                f"{self.dir}: config/weights mismatch: {len(missing)} tensors the config implies are missing "
                f"{missing[:3]}, {len(extra)} tensors are not in the mapping {extra[:3]}; is config.json the one "
                "these weights were saved with?")
        for key, shape in expected.items():
            if self.shape(key) != shape:
                raise ConversionError(f"{self.dir}: config/weights mismatch: '{key}' has shape "
                                      f"{list(self.shape(key))}, config.json implies {list(shape)}")


def shard_name(i: int, n: int) -> str:
    """HF's name of shard ``i`` (0-based) of ``n``."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


Part = tuple[str, dict[str, int]]
"""A written shard: its file name and {tensor name: bytes}."""


def iter_shards(tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int,
                dtype_of: Callable[[str], torch.dtype | None] | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Group streaming (name, tensor) pairs into shards of at most ``max_shard_bytes`` (a larger tensor is
    a shard alone); only one shard is held at a time. Tensors come out on the CPU, contiguous, in their
    own storage (safetensors refuses tensors sharing storage), in ``dtype_of(name)`` (None: their own)."""
    shard: dict[str, torch.Tensor] = {}
    size = 0
    seen: set[str] = set()
    for name, tensor in tensors:
        if name in seen:
            raise ValueError(f"tensor {name} given twice: each name must be written once")
        seen.add(name)
        t = tensor.detach().to("cpu", (dtype_of(name) if dtype_of else None) or tensor.dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if t.storage_offset() or t.untyped_storage().nbytes() != nbytes:
            t = t.clone()  # a view into a larger storage
        if shard and size + nbytes > max_shard_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = t
        size += nbytes
    if shard:
        yield shard


def write_shards(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: pathlib.Path, *, max_shard_bytes: int,
                 stem: str = "shard-", dtype_of: Callable[[str], torch.dtype | None] | None = None,
                 on_shard: Callable[[dict[str, torch.Tensor]], None] | None = None) -> list[Part]:
    """Write the shards of :func:`iter_shards` as ``out_dir/{stem}{i:05d}.safetensors`` as each fills
    (host memory: one shard); ``on_shard`` sees each shard's tensors before they are dropped (checksums).
    :func:`finish_shards` gives the parts (of one or several writers) their HF names."""
    parts = []
    for i, shard in enumerate(iter_shards(tensors, max_shard_bytes, dtype_of)):
        name = f"{stem}{i:05d}.safetensors"
        save_file(shard, str(out_dir / name), metadata={"format": "pt"})
        parts.append((name, {k: t.numel() * t.element_size() for k, t in shard.items()}))
        if on_shard is not None:
            on_shard(shard)
    return parts


def finish_shards(out_dir: pathlib.Path, parts: list[Part], *, single: str | None = SINGLE) -> int:
    """Rename ``parts`` (in ``out_dir``, in order) to ``model-0000i-of-0000n.safetensors`` and write
    the index; a lone part becomes ``single`` without an index (None: named and indexed like the others).
    Returns the total bytes. ValueError when there is nothing to write or a tensor is in two parts."""
    if not parts:
        raise ValueError("no tensors to write")
    names = [n for _, sizes in parts for n in sizes]
    if len(names) != len(set(names)):
        raise ValueError(f"tensors written twice: {sorted({n for n in names if names.count(n) > 1})[:5]}")
    total = sum(sum(sizes.values()) for _, sizes in parts)
    if len(parts) == 1 and single is not None:
        (out_dir / parts[0][0]).replace(out_dir / single)
        return total
    weight_map = {}
    for i, (part, sizes) in enumerate(parts):
        final = shard_name(i, len(parts))
        (out_dir / part).replace(out_dir / final)
        weight_map.update(dict.fromkeys(sizes, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return total


def write_sharded(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: pathlib.Path, *,
                  max_shard_bytes: int, dtype_of) -> int:
    """Write (name, tensor) pairs into ``out_dir`` as ``model-0000i-of-0000n.safetensors`` + index, even
    a single shard; returns total bytes. ``dtype_of(name)`` gives each tensor's on-disk dtype (None: keep)."""
    return finish_shards(out_dir, write_shards(tensors, out_dir, max_shard_bytes=max_shard_bytes, dtype_of=dtype_of),
                         single=None)
