"""Block-FP8 weights for engines that serve FP8 (DeepSeek-V3, GLM-5-FP8): ``rollout.engine_weight_format: fp8_block``.

The scheme of the released checkpoints (``quantization_config.weight_block_size`` [128, 128]):
a linear weight ``W`` [out, in] is sent as ``q`` = float8_e4m3fn [out, in] and
``weight_scale_inv`` ``s`` = fp32 [ceil(out/128), ceil(in/128)] with ``W ~= q * s`` per block;
per block ``s = amax(|W|) / 448`` (float8_e4m3fn's largest value), ``q = W / s``. Which tensors:
those the released checkpoints store quantized, every 2-D linear weight inside the decoder
layers except the MoE router (``mlp.gate.weight``); embeddings, LM head, norms and biases stay
unquantized. Quantizing weights that were dequantized from such a checkpoint (``convert``
imports them so, ``models/families/fp8.py``) gives back its bytes and scales exactly.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
ENGINE_FP8_BLOCK = (128, 128)
"""The block of DeepSeek-V3's and GLM-5-FP8's ``weight_block_size``."""
_QUANTIZED = re.compile(r"^model\.layers\.\d+\..*\.weight$")
_NEVER_QUANTIZED = re.compile(r"\.mlp\.gate\.weight$|norm")


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
