"""Checksums of weights as SGLang 0.5.23's ``/weights_checker`` computes them (``srt/utils/weight_checker.py``).

Per tensor: sha256 of the raw bytes (C order), first 8 bytes read big-endian,
as 16 hex digits (``tensor_hash`` on CPU tensors). Per engine rank:
sha256 over ``name + checksum`` in sorted name order. Buffers whose name
contains a non-persistent pattern (rotary caches) are skipped. CUDA tensors
are hashed on the CPU here (SGLang hashes them with a GPU kernel, so compare
checksums of a GPU engine only with a checker that reads them back).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch

NON_PERSISTENT_PATTERNS = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu")


class WeightMismatchError(RuntimeError):
    """An engine serves weights that differ from the trainer's export (names the first tensors)."""


def tensor_checksum(tensor: torch.Tensor) -> str:
    t = tensor.detach().cpu().contiguous()
    digest = hashlib.sha256(memoryview(t.reshape(-1).view(torch.uint8).numpy())).digest()[:8]
    return f"{int.from_bytes(digest, 'big'):016x}"


def overall_checksum(checksums: Mapping[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def skipped(name: str, skip_tensor_list: Iterable[str] | None = None) -> bool:
    return any(p in name for p in NON_PERSISTENT_PATTERNS) or any(p in name for p in (skip_tensor_list or ()))


def expected_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       dtype: torch.dtype | None = None) -> dict[str, str]:
    """Checksums of exported HF tensors as an engine holding them in ``dtype`` (None: as sent) reports them."""
    out = {}
    for name, tensor in named_tensors:
        out[name] = tensor_checksum(tensor if dtype is None else tensor.to(dtype))
    return out


def compare_checksums(expected: Mapping[str, str], engine: Mapping[str, str], *, where: str,
                      require_all: bool = True) -> int:
    """Raise WeightMismatchError naming the differing tensors; returns how many were compared.

    ``require_all``: every exported tensor must be present on the engine under its HF name (the
    embedded engine reports checkpoint names). SGLang reports its own parameter names, where
    q/k/v and gate/up are fused: there only the tensors named alike on both sides are compared.
    Tensors the engine holds beyond the export (tied copies, buffers) are not the export's business.
    """
    missing = sorted(n for n in expected if n not in engine) if require_all else []
    differ = sorted(n for n in expected if n in engine and engine[n] != expected[n])
    if missing or differ:
        raise WeightMismatchError(
            f"{where}: weights differ from the trainer's export: {len(differ)} tensors differ "
            f"(e.g. {differ[:3]}), {len(missing)} missing on the engine (e.g. {missing[:3]}). The sync "
            f"corrupted or dropped them: stop and check the transport (rollout.weight_sync) and the exporter")
    return sum(n in engine for n in expected)
