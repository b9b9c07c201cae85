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
from collections.abc import Iterable

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


def write_sharded(tensors: Iterable[tuple[str, torch.Tensor]], out_dir: pathlib.Path, *,
                  max_shard_bytes: int, dtype_of) -> int:
    """Write (name, tensor) pairs as ``model-0000i-of-0000n.safetensors`` + index; returns total bytes.

    Tensors arrive streaming; a shard is flushed once it would exceed ``max_shard_bytes``.
    ``dtype_of(name)`` gives each tensor's on-disk dtype (None: keep the tensor's).
    """
    shards: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    size = total = 0
    tmp_names: list[pathlib.Path] = []

    def flush() -> None:
        nonlocal current, size
        if current:
            path = out_dir / f"shard-{len(shards):05d}.tmp"
            save_file(current, str(path), metadata={"format": "pt"})
            tmp_names.append(path)
            shards.append(list(current))
            current, size = {}, 0

    for name, t in tensors:
        t = t.detach().to("cpu", dtype_of(name) or t.dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush()
        current[name] = t.clone() if t.untyped_storage().nbytes() != nbytes else t  # own storage only
        size, total = size + nbytes, total + nbytes
    flush()
    weight_map = {}
    for i, (path, names) in enumerate(zip(tmp_names, shards)):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        path.rename(out_dir / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return total
