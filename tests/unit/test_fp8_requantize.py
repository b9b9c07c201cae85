"""Block-FP8 re-quantization for FP8-serving engines (DeepSeek-V3 / GLM-5-FP8's 128x128 scheme).

Reference: a tiny DeepSeek-V3 checkpoint quantized here block by block with an explicit loop
(the slow obviously-correct path), then read back dequantized as ``convert`` imports it.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from sao_megatron.models.families.fp8 import BlockFp8Checkpoint, dequantize_blocks
from sao_megatron.weights.fp8_block import FP8_MAX, Fp8Scheme, quantize_blocks, requantize

pytestmark = pytest.mark.unit
BLOCK = (16, 16)  # small blocks so tiny weights span several, with ragged edges
DSV3 = Fp8Scheme.from_quantization_config({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                           "weight_block_size": list(BLOCK)})  # DeepSeek-V3's, smaller blocks


def loop_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    (out, inp), (bo, bi) = w.shape, block
    scale = torch.ones(-(-out // bo), -(-inp // bi))
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            blk = w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi].float()
            amax = float(blk.abs().max())
            s = amax / FP8_MAX if amax > 0 else 1.0
            scale[r, c] = s
            q[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi] = (blk / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


@pytest.mark.parametrize("shape", [(40, 24), (16, 16), (7, 50)])
def test_quantize_matches_loop_and_round_trip_within_fp8_error(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05
    w[:3, :3] = 0.0
    q, s = quantize_blocks(w, BLOCK)
    q_ref, s_ref = loop_quantize(w, BLOCK)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == s_ref.shape == (-(-shape[0] // 16), -(-shape[1] // 16))
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert (q.float() != q_ref.float()).float().mean() < 1e-3  # a division rounding may flip one ulp
    back = dequantize_blocks(q, s, BLOCK)
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 of the value, plus the subnormal
    # spacing 2^-9 of the block scale near zero.
    bound = w.abs() * 2.0 ** -4 + s.repeat_interleave(16, 0)[:shape[0]].repeat_interleave(16, 1)[:, :shape[1]] * 2.0 ** -9
    assert bool(((back - w).abs() <= bound + 1e-12).all())


def test_zero_block_gets_scale_one():
    q, s = quantize_blocks(torch.zeros(16, 32), BLOCK)
    assert s.tolist() == [[1.0, 1.0]] and float(q.float().abs().max()) == 0.0


def tiny_fp8_checkpoint(tmp_path):
    """A DeepSeek-V3-named checkpoint whose quantized tensors are stored as the hub ones are."""
    gen = torch.Generator().manual_seed(1)
    full = {"model.embed_tokens.weight": (96, 32), "lm_head.weight": (96, 32), "model.norm.weight": (32,),
            "model.layers.0.self_attn.q_a_proj.weight": (24, 32), "model.layers.0.self_attn.kv_b_proj.weight": (80, 16),
            "model.layers.0.self_attn.q_a_layernorm.weight": (24,), "model.layers.0.mlp.gate.weight": (8, 32),
            "model.layers.0.mlp.experts.3.down_proj.weight": (32, 20),
            "model.layers.0.mlp.shared_experts.up_proj.weight": (20, 32),
            "model.layers.0.self_attn.indexer.wk.weight": (16, 32)}
    weights = {n: torch.randn(shape, generator=gen) * 0.1 for n, shape in full.items()}
    stored = {}
    for n, w in weights.items():
        if DSV3.quantizes(n, tuple(w.shape)):
            stored[n], stored[n + "_scale_inv"] = loop_quantize(w, BLOCK)
        else:
            stored[n] = w
    save_file(stored, str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": dict.fromkeys(stored, "model.safetensors")}))
    return stored


def test_requantized_export_equals_the_original_fp8_checkpoint(tmp_path):
    stored = tiny_fp8_checkpoint(tmp_path)
    ckpt = BlockFp8Checkpoint(tmp_path, BLOCK)
    dequantized = [(n, ckpt.get(n)) for n in sorted(ckpt.weight_map)]  # what convert imports
    assert all(t.dtype == torch.float32 for _, t in dequantized)
    out = dict(requantize(dequantized, DSV3))
    assert set(out) == set(stored)  # same tensors quantized, same scale names
    assert {n for n in out if n.endswith("_scale_inv")} == {
        "model.layers.0.self_attn.q_a_proj.weight_scale_inv", "model.layers.0.self_attn.kv_b_proj.weight_scale_inv",
        "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv",
        "model.layers.0.mlp.shared_experts.up_proj.weight_scale_inv",
        "model.layers.0.self_attn.indexer.wk.weight_scale_inv"}
    for n, t in stored.items():
        assert out[n].dtype == t.dtype and out[n].shape == t.shape, n
        if t.dtype == torch.float8_e4m3fn:  # quant(dequant(q)) is q: same bytes
            assert torch.equal(out[n].view(torch.uint8), t.view(torch.uint8)), n
        else:
            torch.testing.assert_close(out[n], t, rtol=1e-6, atol=0)


def test_fp8_block_needs_an_sglang_engine_and_an_mla_model():
    from sao_megatron.config import load_config
    from sao_megatron.config.loader import ConfigError

    with pytest.raises(ConfigError, match="weight_sync.format=fp8_block needs rollout.engine=sglang"):
        load_config("configs/experiments/tiny_glm5_cpu.yaml", ["rollout.weight_sync.format=fp8_block"])
    with pytest.raises(ConfigError, match="family=qwen3_moe has none"):
        load_config("configs/experiments/tiny_cpu.yaml", ["rollout.weight_sync.format=fp8_block",
                                                          "rollout.engine=sglang",
                                                          "rollout.engine_urls=[http://127.0.0.1:1]"])


def test_weight_sync_sends_fp8_blocks_as_the_engines_config_says(tmp_path):
    """connect asks an engine for its model_path (/model_info) and quantizes as its config.json says."""
    import httpx

    from sao_megatron.config import load_config
    from sao_megatron.weights import transports as weight_sync
    from sao_megatron.weights.distributed import _World

    pushed = {}
    served = tmp_path / "served"
    served.mkdir()
    (served / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 64],
        "modules_to_not_convert": ["model.layers.1.mlp.experts.1.up_proj"]}}))

    def engine(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/model_info"
        return httpx.Response(200, json={"model_path": str(served), "weight_version": "0"})

    class Recorder:
        world = _World.alone()
        http = httpx.Client(transport=httpx.MockTransport(engine))

        def connect(self, engine_urls, *, is_sender):
            pass

        def push(self, owned, version, *, paused=None, verify=False):
            pushed.update(dict(owned))
            return {}

    cfg = load_config("configs/experiments/tiny_glm5_cpu.yaml", ["rollout.engine=sglang",
                                                                 "rollout.engine_urls=[http://127.0.0.1:1]",
                                                                 "rollout.weight_sync.format=fp8_block"])
    sync = weight_sync.build_weight_sync(cfg.rollout, client=None, run_dir=tmp_path, template_dir=None)
    sync.inner = Recorder()
    sync.connect(["http://engine:1"], is_sender=True)
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(2))
    sync.push([("model.layers.0.mlp.experts.0.up_proj.weight", w), ("model.layers.1.mlp.experts.0.up_proj.weight", w),
               ("model.norm.weight", torch.ones(64))], 1)
    assert pushed["model.layers.0.mlp.experts.0.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert pushed["model.layers.0.mlp.experts.0.up_proj.weight_scale_inv"].shape == (3, 4)  # 128x64 blocks
    assert pushed["model.norm.weight"].dtype == torch.float32
    # SGLang decides per FusedMoE (``...mlp.experts``): an expert listed leaves the layer's experts unquantized.
    assert pushed["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.float32
