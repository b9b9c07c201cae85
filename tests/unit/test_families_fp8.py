"""Block-FP8 checkpoints (DeepSeek-V3 / GLM-5-FP8 layout): import dequantizes, scales are not model tensors.

The reference is a slow per-element loop; the checkpoint is a tiny GLM-5 written by transformers
and block-quantized here the way DeepSeek's release is (float8_e4m3fn + fp32 weight_scale_inv).
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sao_megatron.models.families import ConversionError
from sao_megatron.models.families.fp8 import BlockFp8Checkpoint, dequantize_blocks, strip_quantization_config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "component" / "convert_scripts"))
import mla_fixtures  # noqa: E402

pytestmark = pytest.mark.unit
BLOCK = (8, 8)


def slow_dequant(q: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(q.shape[0]):
        for j in range(q.shape[1]):
            out[i, j] = q[i, j].float() * s[i // block[0], j // block[1]]
    return out


def quantize(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block amax / 448 scales (DeepSeek's recipe); returns (float8 weight, fp32 scale_inv)."""
    rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
    scale = torch.empty(rows, cols)
    for r in range(rows):
        for c in range(cols):
            blk = w[r * block[0]:(r + 1) * block[0], c * block[1]:(c + 1) * block[1]]
            scale[r, c] = blk.abs().max().clamp(min=1e-12) / 448.0
    full = scale.repeat_interleave(block[0], 0)[:w.shape[0]].repeat_interleave(block[1], 1)[:, :w.shape[1]]
    return (w / full).to(torch.float8_e4m3fn), scale


def test_dequantize_blocks_equals_the_elementwise_definition():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(13, 21, generator=gen)
    q, s = quantize(w, (4, 8))
    assert torch.equal(dequantize_blocks(q, s, (4, 8)), slow_dequant(q, s, (4, 8)))
    assert (dequantize_blocks(q, s, (4, 8)) - w).abs().max() < 0.07 * w.abs().max()
    with pytest.raises(ConversionError, match="weight_scale_inv"):
        dequantize_blocks(q, s[:, :1], (4, 8))


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    """glm5_full_idx saved by transformers, then every linear weight block-quantized in place."""
    base = tmp_path_factory.mktemp("fp8")
    ref = mla_fixtures.write_hf_dir("glm5_full_idx", base / "ref")
    out = base / "fp8"
    out.mkdir()
    index = json.loads((ref / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(ref / shard), "pt") as f:
            tensors |= {k: f.get_tensor(k) for k in f.keys()}
    quantized = {}
    for k, t in tensors.items():
        if t.dim() == 2 and not any(x in k for x in ("embed_tokens", "lm_head", "mlp.gate.", "weights_proj")):
            quantized[k], quantized[k + "_scale_inv"] = quantize(t, BLOCK)
        else:
            quantized[k] = t
    save_file(quantized, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((ref / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(BLOCK)}
    (out / "config.json").write_text(json.dumps(cfg))
    return ref, out, quantized


def test_import_dequantizes_every_quantized_weight_and_hides_the_scales(fp8_dir):
    from checkpoints_tools.hf_to_mcore import open_hf

    ref, out, quantized = fp8_dir
    src, plain = open_hf(out), open_hf(ref)
    assert isinstance(src.ckpt, BlockFp8Checkpoint) and src.model_cfg == plain.model_cfg
    assert not [k for k in src.ckpt.keys() if k.endswith("_scale_inv")]
    names = [k for k in quantized if k.endswith(".weight") and k + "_scale_inv" in quantized]
    assert len(names) > 20 and any(".indexer.wq_b." in k for k in names)
    for k in names:
        assert torch.equal(src.ckpt.get(k), slow_dequant(quantized[k], quantized[k + "_scale_inv"], BLOCK)), k
    assert torch.equal(src.ckpt.get("model.norm.weight"), plain.ckpt.get("model.norm.weight"))


def test_export_config_drops_the_quantization_config(fp8_dir, tmp_path):
    _, out, _ = fp8_dir
    path = tmp_path / "config.json"
    path.write_text((out / "config.json").read_text())
    strip_quantization_config(path)
    cfg = json.loads(path.read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "glm_moe_dsa"
