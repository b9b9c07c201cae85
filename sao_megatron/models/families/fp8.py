"""Block-FP8 HF checkpoints (DeepSeek-V3, GLM-5-FP8): ``weight`` in float8 plus ``weight_scale_inv`` per block.

Layout (DeepSeek's, also read by transformers and SGLang): a quantized linear weight
``W`` [out, in] is stored as ``q`` = float8_e4m3fn [out, in] and ``s`` = fp32
[ceil(out / bo), ceil(in / bi)] for ``quantization_config.weight_block_size`` = [bo, bi];
``W[i, j] = q[i, j] * s[i // bo, j // bi]``. Import dequantizes (the trainer works in
bf16/fp32); the scales are not model tensors. Export writes bf16 and drops the
``quantization_config`` from the copied config.json.

For engines that serve FP8 (``rollout.engine_weight_format: fp8_block``), the weight sync
re-quantizes with the same scheme (:func:`requantize`): per 128x128 block,
``s = amax(|W|) / 448`` (float8_e4m3fn's largest value), ``q = W / s``. Which tensors: those the
released DeepSeek-V3 / GLM-5-FP8 checkpoints store quantized, every 2-D linear weight inside
the decoder layers except the MoE router (``mlp.gate.weight``); embeddings, LM head, norms and
biases stay unquantized. Re-quantizing dequantized weights is exact (same bytes, same scales).
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from sao_megatron.models.families.base import ConversionError
from sao_megatron.models.families.hf_files import HfCheckpoint

SCALE_SUFFIX = "_scale_inv"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
ENGINE_FP8_BLOCK = (128, 128)
"""The block of DeepSeek-V3's and GLM-5-FP8's ``weight_block_size``, used for FP8-serving engines."""
_QUANTIZED = re.compile(r"^model\.layers\.\d+\..*\.weight$")
_NEVER_QUANTIZED = re.compile(r"\.mlp\.gate\.weight$|norm")


def fp8_block_size(hf_config: dict[str, Any]) -> tuple[int, int] | None:
    """(rows, cols) of a block-FP8 checkpoint's scale blocks; None for an unquantized checkpoint."""
    quant = hf_config.get("quantization_config") or {}
    if not quant:
        return None
    if quant.get("quant_method") != "fp8" or len(quant.get("weight_block_size") or ()) != 2:
        raise ConversionError(f"quantization_config {quant} is not supported; only block FP8 "
                              "(quant_method 'fp8' with weight_block_size [rows, cols])")
    rows, cols = quant["weight_block_size"]
    return int(rows), int(cols)


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 [out, in] from float8 ``q`` [out, in] and ``scale_inv`` [ceil(out/bo), ceil(in/bi)]."""
    (out, inp), (bo, bi) = q.shape, block
    if scale_inv.shape != (-(-out // bo), -(-inp // bi)):
        raise ConversionError(f"weight_scale_inv has shape {list(scale_inv.shape)}, a [{out}, {inp}] weight in "
                              f"{bo}x{bi} blocks needs [{-(-out // bo)}, {-(-inp // bi)}]")
    scale = scale_inv.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :inp]
    return q.float() * scale


class BlockFp8Checkpoint(HfCheckpoint):
    """HfCheckpoint whose quantized weights read back dequantized (fp32); scale tensors are hidden."""

    def __init__(self, hf_dir: str | pathlib.Path, block: tuple[int, int]):
        super().__init__(hf_dir)
        self.block = block
        self.scale_of = {k[: -len(SCALE_SUFFIX)]: k for k in self.weight_map if k.endswith(SCALE_SUFFIX)}
        self._scale_shards = {k: self.weight_map.pop(k) for k in list(self.scale_of.values())}

    def get(self, name: str) -> torch.Tensor:
        t = super().get(name)
        scale_name = self.scale_of.get(name)
        if scale_name is None:
            return t
        scale = self._files[self._scale_shards[scale_name]].get_tensor(scale_name)
        return dequantize_blocks(t, scale, self.block)


def open_checkpoint(hf_dir: str | pathlib.Path, hf_config: dict[str, Any]) -> HfCheckpoint:
    """The checkpoint reader for ``hf_dir``: dequantizing for block-FP8 checkpoints."""
    block = fp8_block_size(hf_config)
    return HfCheckpoint(hf_dir) if block is None else BlockFp8Checkpoint(hf_dir, block)


def strip_quantization_config(config_path: pathlib.Path) -> None:
    """Remove ``quantization_config`` from an exported config.json (its weights are written unquantized)."""
    cfg = json.loads(config_path.read_text())
    if cfg.pop("quantization_config", None) is not None:
        config_path.write_text(json.dumps(cfg, indent=2) + "\n")


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [out, in], fp32 ``weight_scale_inv`` [ceil(out/bo), ceil(in/bi)]) of a 2-D weight.

    Per block: scale = amax / FP8_MAX (1 for an all-zero block), q = w / scale rounded to float8.
    """
    (out, inp), (bo, bi) = w.shape, block
    rows, cols = -(-out // bo), -(-inp // bi)
    padded = torch.zeros(rows * bo, cols * bi, dtype=torch.float32, device=w.device)
    padded[:out, :inp] = w.float()
    blocks = padded.view(rows, bo, cols, bi)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows * bo, cols * bi)[:out, :inp].contiguous(), scale


def is_fp8_quantized(hf_name: str, shape: tuple[int, ...]) -> bool:
    """Whether a block-FP8 DeepSeek-V3 / GLM-5 checkpoint stores this tensor quantized (see module doc)."""
    return len(shape) == 2 and bool(_QUANTIZED.match(hf_name)) and not _NEVER_QUANTIZED.search(hf_name)


def requantize(named: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int] = ENGINE_FP8_BLOCK,
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors an FP8-serving engine loads: quantized weights as (name, fp8) + (name_scale_inv, fp32)."""
    for name, tensor in named:
        if is_fp8_quantized(name, tuple(tensor.shape)):
            q, scale = quantize_blocks(tensor, block)
            yield name, q
            yield name + SCALE_SUFFIX, scale
        else:
            yield name, tensor
