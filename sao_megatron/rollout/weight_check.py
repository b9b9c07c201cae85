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

SGLang also reports its OWN parameter names, where checkpoint tensors are fused (the models'
``load_weights``: ``stacked_params_mapping``, ``FusedMoE.make_expert_params_mapping``):
``q_proj``/``k_proj``/``v_proj`` → ``qkv_proj`` (concatenated along dim 0), ``gate_proj``/``up_proj``
→ ``gate_up_proj``, the experts ``experts.{e}.gate_proj``/``up_proj`` → ``experts.w13_weight``
``[E, 2·I, H]`` (expert e's gate rows, then its up rows) and ``experts.{e}.down_proj`` →
``experts.w2_weight`` ``[E, H, I]``, DeepSeek's ``q_a_proj``/``kv_a_proj_with_mqa`` →
``fused_qkv_a_proj_with_mqa`` (``models/deepseek_common/deepseek_weight_loader.py``).
:func:`held_checksums` hashes checkpoint tensors under those names (the embedded engine reports
the same names): a fused tensor's checksum hashes its parts' bytes in order, with no copy.
"""

from __future__ import annotations

import hashlib
import re
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


# Checkpoint tensors SGLang stacks into one parameter, in the order of their rows there.
_STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
            "q_a_proj": ("fused_qkv_a_proj_with_mqa", 0), "kv_a_proj_with_mqa": ("fused_qkv_a_proj_with_mqa", 1)}
_STACKED_PART = re.compile(rf"^(.*)\.({'|'.join(_STACKED)})\.(weight|bias)$")
_EXPERT_PART = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PARAM = {"gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1), "down_proj": ("w2_weight", 0)}


def held_name(name: str) -> str:
    """The SGLang parameter that holds checkpoint tensor ``name`` (``name`` itself when not fused)."""
    if m := _EXPERT_PART.match(name):
        return f"{m[1]}.{_EXPERT_PARAM[m[3]][0]}"
    if m := _STACKED_PART.match(name):
        return f"{m[1]}.{_STACKED[m[2]][0]}.{m[3]}"
    return name


def _part_key(name: str) -> tuple[int, int]:
    """Where a fused part's bytes go: (expert, position inside the expert's or the stack's rows)."""
    if m := _EXPERT_PART.match(name):
        return int(m[2]), _EXPERT_PARAM[m[3]][1]
    return 0, _STACKED[_STACKED_PART.match(name)[2]][1]


def _complete(held: str, parts: dict[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> bool:
    """Every part of the fused parameter ``held`` is in ``parts``: all three of q/k/v, both of gate/up,
    every expert (their number is the router's rows, ``<layer>.mlp.gate.weight``)."""
    keys = {_part_key(n) for n in parts}
    if held.endswith((".w13_weight", ".w2_weight")):
        router = tensors.get(held.rsplit(".experts.", 1)[0] + ".gate.weight")
        per_expert = 2 if held.endswith(".w13_weight") else 1
        return router is not None and keys == {(e, k) for e in range(router.shape[0]) for k in range(per_expert)}
    stack = [k for k, (param, _) in _STACKED.items() if held.rsplit(".", 2)[-2] == param]
    return keys == {(0, i) for i in range(len(stack))}


def held_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    """Checkpoint tensors grouped as SGLang holds them: held name → its parts in byte order.

    A fused parameter missing a part here (its tensors split over several export chunks or ranks)
    keeps its parts under their checkpoint names: they cannot be hashed as the engine holds them."""
    tensors = dict(named_tensors)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        groups.setdefault(held_name(name), {})[name] = t
    out: dict[str, list[torch.Tensor]] = {}
    for held, parts in groups.items():
        if held in parts:  # not fused
            out[held] = [parts[held]]
        elif _complete(held, parts, tensors):
            out[held] = [parts[n] for n in sorted(parts, key=_part_key)]
        else:
            out.update((n, [t]) for n, t in parts.items())
    return out


def parts_checksum(parts: Iterable[torch.Tensor]) -> str:
    """:func:`tensor_checksum` of the concatenation of ``parts`` (rows of one fused parameter)."""
    h = hashlib.sha256()
    for t in parts:
        h.update(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return f"{int.from_bytes(h.digest()[:8], 'big'):016x}"


def held_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]],
                   holding: EngineHolding | None = None) -> dict[str, str]:
    """Checksums of checkpoint tensors under SGLang's parameter names, as an engine holding them as
    ``holding`` reports them (None: the bytes as sent)."""
    holding = holding or EngineHolding(None)
    return {held: parts_checksum(as_held(held, t, holding) for t in parts)
            for held, parts in held_tensors(named_tensors).items()}


class StreamingChecksums:
    """:func:`held_checksums` of an export that arrives in pieces (disk shards, distributed buckets).

    Per piece, a fused parameter whose parts straddle two pieces could not be hashed as the engine holds
    it, and was left unverified. This hashes each fused parameter across pieces: a part in its place
    (the export's order: q, k, v; expert 0's gate, up, then expert 1's ...) goes straight into the
    parameter's running sha256, a part ahead of its place waits as a copy until the parts before it came.
    A parameter still missing parts at :meth:`result` (experts on another rank) keeps its parts under their
    checkpoint names, unverifiable against the engine as before (``weight_sync/unverified_tensors``)."""

    def __init__(self, holding: EngineHolding | None = None):
        self.holding = holding or EngineHolding(None)
        self._done: dict[str, str] = {}
        self._fused: dict[str, _FusedHash] = {}
        self._experts: dict[str, int] = {}  # "<layer>.mlp" → number of experts (the router's rows)

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            held = held_name(name)
            t = as_held(held, tensor, self.holding)
            if name.endswith(".gate.weight") and t.dim() == 2:
                self._experts[name.removesuffix(".gate.weight")] = t.shape[0]
            if held == name:
                self._done[name] = tensor_checksum(t)
            else:
                self._fused.setdefault(held, _FusedHash(held)).add(name, t)

    def result(self) -> dict[str, str]:
        out = dict(self._done)
        for held, fused in self._fused.items():
            if fused.complete(self._experts.get(held.rsplit(".experts.", 1)[0])):
                out[held] = f"{int.from_bytes(fused.sha.digest()[:8], 'big'):016x}"
            else:
                out |= fused.part_sums
        return out


class _FusedHash:
    """One fused parameter's running hash (see :class:`StreamingChecksums`)."""

    def __init__(self, held: str):
        self.per_expert = 2 if held.endswith(".w13_weight") else 1
        self.experts = held.endswith((".w13_weight", ".w2_weight"))
        self.stack = sum(param == held.rsplit(".", 2)[-2] for param, _ in _STACKED.values())
        self.sha = hashlib.sha256()
        self.next = (0, 0)
        self.waiting: dict[tuple[int, int], torch.Tensor] = {}
        self.part_sums: dict[str, str] = {}
        self.seen = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        self.part_sums[name] = tensor_checksum(t)
        self.seen += 1
        key = _part_key(name)
        if key != self.next:  # ahead of its place (or a stray): kept until its turn
            self.waiting[key] = t.detach().cpu().clone()
            return
        self._feed(t)
        while self.next in self.waiting:
            self._feed(self.waiting.pop(self.next))

    def _feed(self, t: torch.Tensor) -> None:
        self.sha.update(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
        e, k = self.next
        self.next = (e + 1, 0) if self.experts and k + 1 == self.per_expert else (e, k + 1)

    def complete(self, num_experts: int | None) -> bool:
        if self.waiting:
            return False
        if self.experts:
            return num_experts is not None and self.next == (num_experts, 0) and self.seen == num_experts * self.per_expert
        return self.next == (0, self.stack) and self.seen == self.stack


def expected_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]],
                       holding: EngineHolding | None = None) -> dict[str, str]:
    """Checksums of exported HF tensors as an engine holding them as ``holding`` reports them
    (None: the bytes as sent), under the engine's (SGLang's fused) names."""
    return held_checksums(named_tensors, holding)


def compare_checksums(expected: Mapping[str, str], engine: Mapping[str, str], *, where: str,
                      require_all: bool = True) -> int:
    """Raise WeightMismatchError naming the differing tensors; returns how many were compared.

    ``require_all``: every exported tensor must be present on the engine under its held name (the
    embedded engine fuses exactly as :func:`held_tensors` does); a part of a fused parameter left
    unfused (split over export chunks) cannot be compared and is not required. Without it (SGLang,
    whose names for families not covered here may differ) only the tensors named alike on both sides
    are compared. Tensors the engine holds beyond the export (tied copies, buffers) are not the
    export's business.
    """
    missing = sorted(n for n in expected if n not in engine and held_name(n) == n) if require_all else []
    differ = sorted(n for n in expected if n in engine and engine[n] != expected[n])
    if missing or differ:
        raise WeightMismatchError(
            f"{where}: weights differ from the trainer's export: {len(differ)} tensors differ "
            f"(e.g. {differ[:3]}), {len(missing)} missing on the engine (e.g. {missing[:3]}). The sync "
            f"corrupted or dropped them: stop and check the transport (rollout.weight_sync.transport) and the exporter")
    return sum(n in engine for n in expected)
