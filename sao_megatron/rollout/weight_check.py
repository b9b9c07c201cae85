"""Checksums of weights as an engine's ``/weights_checker`` reports them (SGLang 0.5.23
``srt/utils/weight_checker.py``), so verification compares like with like.

SGLang hashes what it HOLDS, not what was sent (``_compute_checksum``: ``tensor_hash`` of
``comparable.dequantize().data`` for every parameter and buffer). What it holds differs from
the export in three ways, each reproduced here from an :class:`EngineHolding` read off the
engine's ``/server_info``:
- the dtype: parameters live in the engine's dtype (``--dtype``; ``auto`` is the checkpoint's
  ``torch_dtype`` except float32 → float16, ``srt/configs/model_config.py:_get_and_verify_dtype``);
  the embedded engine holds float32 whatever it is sent;
- vocabulary padding: ``VocabParallelEmbedding`` / ``ParallelLMHead`` pad their rows to a
  multiple of 64 (``DEFAULT_VOCAB_PADDING_SIZE``) and zero the padding
  (``srt/layers/vocab_parallel_embedding.py``: ``param[loaded_weight.shape[0]:].data.fill_(0)``);
- the hash: sha256 of the raw bytes on CPU (first 8 bytes, big-endian, 16 hex digits:
  ``srt/managers/mm_utils.py:tensor_hash``), a Triton kernel on CUDA
  (``kernels/ops/memory/gpu_tensor_hash.py``) that this module does not reproduce: CUDA engines
  are reported unverified rather than compared with the wrong hash.
FP8 weights are hashed dequantized to bfloat16 (``Fp8BlockComparable.dequantize``): an engine
holding FP8 is reported unverified too. Per engine rank: sha256 over ``name + checksum`` in sorted
name order. Buffers whose name contains a non-persistent pattern (rotary caches) are skipped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

NON_PERSISTENT_PATTERNS = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu")
VOCAB_PADDING = 64
"""SGLang's ``DEFAULT_VOCAB_PADDING_SIZE`` (rows of embeddings and the LM head)."""
_VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight")
_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16}


class WeightMismatchError(RuntimeError):
    """An engine serves weights that differ from the trainer's export (names the first tensors)."""


@dataclass(frozen=True, slots=True)
class EngineHolding:
    """How an engine holds the weights it reports checksums of."""

    dtype: torch.dtype | None
    """Every floating-point parameter's dtype on the engine (None: as sent)."""
    vocab_padding: int = 1
    """Embedding and LM-head rows are padded (with zeros) to a multiple of this."""
    unverifiable: str | None = None
    """Why this engine's checksums cannot be reproduced here (then nothing is compared)."""

    @classmethod
    def from_server_info(cls, info: Mapping, *, checkpoint_dtype: str | None,
                         quantized: bool = False) -> EngineHolding:
        """From an engine's ``/server_info`` (``checkpoint_dtype``: the export's config ``torch_dtype``;
        ``quantized``: the engine is sent FP8 weights)."""
        if quantized:
            return cls(None, unverifiable="FP8 weights: engines hash them dequantized to bfloat16")
        if "sao-embedded" in str(info.get("version", "")):
            return cls(torch.float32)  # AutoModelForCausalLM.from_pretrained(dtype=torch.float32)
        tp = int(info.get("tp_size", 1) or 1)
        if tp > 1:
            return cls(None, unverifiable=f"tp_size={tp}: ranks report checksums of shards, not full tensors")
        if str(info.get("device", "cuda")) != "cpu":
            return cls(None, unverifiable="a CUDA engine hashes with SGLang's Triton gpu_tensor_hash")
        if info.get("quantization"):
            return cls(None, unverifiable=f"quantization={info['quantization']}: SGLang hashes dequantized weights")
        return cls(sglang_dtype(str(info.get("dtype", "auto")), checkpoint_dtype), VOCAB_PADDING)


def sglang_dtype(dtype: str, checkpoint_dtype: str | None) -> torch.dtype:
    """SGLang's ``_get_and_verify_dtype`` for the non-Gemma models served here."""
    if dtype.lower() != "auto":
        return _DTYPES[dtype.lower()]
    held = _DTYPES.get(str(checkpoint_dtype or "float32").removeprefix("torch."), torch.float32)
    return torch.float16 if held == torch.float32 else held


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


def as_held(name: str, tensor: torch.Tensor, holding: EngineHolding) -> torch.Tensor:
    """``tensor`` as the engine holds it: cast to its dtype, vocabulary rows zero-padded."""
    t = tensor.detach()
    if holding.dtype is not None and t.is_floating_point():
        t = t.to(holding.dtype)
    rows = t.shape[0] if t.dim() else 0
    if holding.vocab_padding > 1 and name.endswith(_VOCAB_TENSORS) and rows % holding.vocab_padding:
        padded = -(-rows // holding.vocab_padding) * holding.vocab_padding
        t = torch.cat([t, t.new_zeros((padded - rows, *t.shape[1:]))])
    return t


def expected_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]],
                       holding: EngineHolding | None = None) -> dict[str, str]:
    """Checksums of exported HF tensors as an engine holding them as ``holding`` reports them
    (None: the bytes as sent)."""
    holding = holding or EngineHolding(None)
    return {name: tensor_checksum(as_held(name, tensor, holding)) for name, tensor in named_tensors}


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
