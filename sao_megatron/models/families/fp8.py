"""Block-FP8 HF checkpoints (DeepSeek-V3, GLM-5-FP8): ``weight`` in float8 plus ``weight_scale_inv`` per block.

Layout (DeepSeek's, also read by transformers and SGLang): a quantized linear weight
``W`` [out, in] is stored as ``q`` = float8_e4m3fn [out, in] and ``s`` = fp32
[ceil(out / bo), ceil(in / bi)] for ``quantization_config.weight_block_size`` = [bo, bi];
``W[i, j] = q[i, j] * s[i // bo, j // bi]``. Import dequantizes (the trainer works in
bf16/fp32); the scales are not model tensors. Export writes bf16 and drops the
``quantization_config`` from the copied config.json.

For engines that serve FP8 the weight sync re-quantizes with the same scheme
(``weights/fp8_block.py``, ``rollout.weight_sync.format: fp8_block``).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import torch

from sao_megatron.models.families.base import ConversionError
from sao_megatron.models.families.hf_files import HfCheckpoint

SCALE_SUFFIX = "_scale_inv"


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

