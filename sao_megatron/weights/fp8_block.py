"""Block-FP8 weights for engines that serve FP8 (DeepSeek-V3, GLM-5-FP8): ``rollout.weight_sync.format: fp8_block``.

What to quantize and how comes from the engine's own ``quantization_config`` (the ``config.json``
it serves, :meth:`Fp8Scheme.from_hf_config`), read the way SGLang 0.5.23's ``Fp8Config.from_config``
reads it (``srt/layers/quantization/fp8.py``):
- ``quant_method`` "fp8" (``fmt`` e4m3 where given) with ``activation_scheme`` "dynamic";
- ``weight_block_size`` [bo, bi]: a linear weight ``W`` [out, in] is sent as ``q`` = float8_e4m3fn
  [out, in] and ``weight_scale_inv`` ``s`` = fp32 [ceil(out/bo), ceil(in/bi)] with ``W ~= q * s``
  per block; ``s = amax(|W|) / 448`` (float8_e4m3fn's largest value), rounded up to a power of two
  when ``scale_fmt`` is "ue8m0"; ``q = W / s``;
- ``modules_to_not_convert`` (alias ``ignored_layers``): modules SGLang builds unquantized, matched
  as its ``is_layer_skipped`` matches them (``srt/layers/quantization/utils.py``): GLM-5-FP8 lists
  its DSA indexers' ``weights_proj`` there.
Which tensors can be quantized at all is the engine's model structure: the 2-D weights of linear
layers inside the decoder layers that SGLang builds with the quantization config. Embeddings, the
LM head, norms and biases are not such layers, nor are the MoE router (``MoEGate``: a bare
parameter) and the indexer's ``weights_proj`` (built with ``quant_config=None``);
``tests/unit/test_fp8_scheme.py`` checks both against the wheel. Quantizing weights that were
dequantized from such a checkpoint (``convert`` imports them so, ``models/families/fp8.py``) gives
back its bytes and scales exactly.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
ENGINE_UNQUANTIZED = ("mlp.gate", "self_attn.indexer.weights_proj")
"""Decoder modules SGLang's DeepSeek/GLM-5 model never builds quantized (see the module docstring)."""
_FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""SGLang's ``_FALLBACK_FUSED_SHARDS``: a fused linear is skipped when its shards are."""


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How an engine's ``quantization_config`` wants the weights: block size, scale format, skipped modules."""

    block: tuple[int, int]
    """``weight_block_size``: rows and columns of one scale block."""
    not_converted: tuple[str, ...] = ()
    """``modules_to_not_convert``, each with and without the ``model.`` prefix (as SGLang normalises them)."""
    ue8m0: bool = False
    """``scale_fmt: ue8m0``: scales are powers of two."""

    @classmethod
    def from_quantization_config(cls, qc: Mapping[str, Any], source: str = "quantization_config") -> Fp8Scheme:
        """The scheme of a block-FP8 ``quantization_config``; ValueError naming what is not supported."""
        method, fmt = str(qc.get("quant_method", "")), qc.get("fmt", "e4m3")
        block = qc.get("weight_block_size")
        if method != "fp8" or fmt != "e4m3" or qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"{source}: rollout.weight_sync.format=fp8_block sends block-FP8 e4m3 weights with "
                             f"dynamic activation scales; this engine serves quant_method={method!r}, fmt={fmt!r}, "
                             f"activation_scheme={qc.get('activation_scheme')!r}: serve a block-FP8 checkpoint or "
                             f"use rollout.weight_sync.format=unquantized")
        if not isinstance(block, (list, tuple)) or len(block) != 2:
            raise ValueError(f"{source}: weight_block_size={block!r} is not [rows, cols]; per-tensor FP8 is not "
                             f"supported: use rollout.weight_sync.format=unquantized")
        if qc.get("scale_fmt") not in (None, "ue8m0"):
            raise ValueError(f"{source}: scale_fmt={qc['scale_fmt']!r} is not supported (none or 'ue8m0')")
        skipped = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
        names = tuple(p for m in skipped for p in (m.removeprefix("model."), "model." + m.removeprefix("model.")))
        return cls(block=(int(block[0]), int(block[1])), not_converted=names, ue8m0=qc.get("scale_fmt") == "ue8m0")

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any], source: str = "config.json") -> Fp8Scheme:
        qc = hf_config.get("quantization_config")
        if not qc:
            raise ValueError(f"{source} has no quantization_config: the engine serves unquantized weights; use "
                             f"rollout.weight_sync.format=unquantized")
        return cls.from_quantization_config(qc, f"{source} quantization_config")

    @classmethod
    def from_model_dir(cls, model_dir: str | pathlib.Path) -> Fp8Scheme:
        """The scheme in ``<model_dir>/config.json`` (an engine's ``model_path``)."""
        path = pathlib.Path(model_dir) / "config.json"
        return cls.from_hf_config(json.loads(path.read_text()), str(path))

    def quantizes(self, hf_name: str, shape: tuple[int, ...]) -> bool:
        """Whether the engine holds this HF tensor in block FP8 (a weight + ``weight_scale_inv``)."""
        if len(shape) != 2 or not hf_name.startswith("model.layers.") or not hf_name.endswith(".weight"):
            return False
        module = hf_name.removesuffix(".weight")
        if any(module.endswith("." + m) for m in ENGINE_UNQUANTIZED):
            return False
        return not self._skipped(_engine_module(module))

    def _skipped(self, prefix: str) -> bool:
        """SGLang's ``is_layer_skipped(prefix, ignored_layers)`` without a packed_modules_mapping."""
        proj = prefix.split(".")[-1]
        if proj in _FUSED_SHARDS:
            shards = {any(_path_match(i, prefix.replace(proj, s)) for i in self.not_converted)
                      for s in _FUSED_SHARDS[proj]}
            if len(shards) > 1:
                raise ValueError(f"modules_to_not_convert skips some but not all shards of {prefix}: SGLang "
                                 f"refuses such a checkpoint")
            return shards.pop()
        skipped = any(_path_match(i, prefix) for i in self.not_converted)
        if "experts" in prefix:
            skipped = skipped or any(prefix in i for i in self.not_converted if "experts" in i)
        return skipped

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float8 weight, fp32 weight_scale_inv) in this scheme's blocks and scale format."""
        return quantize_blocks(w, self.block, ue8m0=self.ue8m0)


def _engine_module(module: str) -> str:
    """The SGLang module an HF module loads into (its quantization is decided there)."""
    if ".mlp.experts." in module:
        return module.split(".mlp.experts.", 1)[0] + ".mlp.experts"  # one FusedMoE per layer
    head, _, proj = module.rpartition(".")
    if proj in ("q_a_proj", "kv_a_proj_with_mqa"):
        return f"{head}.fused_qkv_a_proj_with_mqa"
    fused = next((f for f, shards in _FUSED_SHARDS.items() if proj in shards), None)
    return f"{head}.{fused}" if fused else module


def _path_match(ignored: str, prefix: str) -> bool:
    """SGLang's ``_module_path_match``: a match on dotted module-path boundaries."""
    ignored, prefix = ignored.rstrip("."), prefix.rstrip(".")
    return ignored == prefix or prefix.startswith(ignored + ".") or f".{ignored}." in f".{prefix}."


def quantize_blocks(w: torch.Tensor, block: tuple[int, int], *, ue8m0: bool = False,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [out, in], fp32 ``weight_scale_inv`` [ceil(out/bo), ceil(in/bi)]) of a 2-D weight.

    Per block: scale = amax / FP8_MAX (1 for an all-zero block; rounded up to a power of two with
    ``ue8m0``), q = w / scale rounded to float8.
    """
    (out, inp), (bo, bi) = w.shape, block
    rows, cols = -(-out // bo), -(-inp // bi)
    padded = torch.zeros(rows * bo, cols * bi, dtype=torch.float32, device=w.device)
    padded[:out, :inp] = w.float()
    blocks = padded.view(rows, bo, cols, bi)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows * bo, cols * bi)[:out, :inp].contiguous(), scale


def requantize(named: Iterable[tuple[str, torch.Tensor]], scheme: Fp8Scheme) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors an FP8-serving engine loads: quantized weights as (name, fp8) + (name_scale_inv, fp32)."""
    for name, tensor in named:
        if scheme.quantizes(name, tuple(tensor.shape)):
            q, scale = scheme.quantize(tensor)
            yield name, q
            yield name + SCALE_SUFFIX, scale
        else:
            yield name, tensor


def engine_scheme(model_info: Mapping[str, Any]) -> Fp8Scheme:
    """The scheme of the checkpoint an engine serves, from its ``/model_info`` reply (``model_path``).

    The trainer reads ``<model_path>/config.json``: the engines' model directory must be visible
    to rank 0 at the same path (a shared file system, as for ``rollout.weight_sync.transport=disk``).
    """
    path = model_info.get("model_path") or ""
    if not path or not (pathlib.Path(path) / "config.json").is_file():
        raise ValueError(f"rollout.weight_sync.format=fp8_block reads the engine's quantization_config from "
                         f"<model_path>/config.json, and the engine's model_path {path!r} has none on this host: "
                         f"serve the model from a directory the trainer's rank 0 can read at the same path")
    return Fp8Scheme.from_model_dir(path)

