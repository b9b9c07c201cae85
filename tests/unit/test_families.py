"""HF config <-> ModelConfig translation, the mapping transforms and the unsupported-model errors.

References: hand-written expected ModelConfigs, transformers' own config classes (how
transformers reads a config.json we generate), and slow per-head loops for the QKV layout.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
import sys

import pytest
import torch

from sao_megatron.config.schema import ModelConfig
from sao_megatron.models.families import (
    ConversionError, family_for_hf, get_family, hf_config_from_model, model_config_from_hf,
)
from sao_megatron.models.families import base

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "component" / "convert_scripts"))
from hf_fixtures import SHAPES  # noqa: E402

pytestmark = pytest.mark.unit


def to_transformers5_style(hub: dict) -> dict:
    """What transformers 5 writes for the same model: num_local_experts, rope_parameters."""
    out = copy.deepcopy(hub)
    if "num_experts" in out:
        out["num_local_experts"] = out.pop("num_experts")
    rope = {"rope_type": "default", "rope_theta": out.pop("rope_theta")}
    if "partial_rotary_factor" in out:
        rope["partial_rotary_factor"] = out.pop("partial_rotary_factor")
    out["rope_parameters"] = rope
    out["dtype"] = out.pop("torch_dtype")
    return out


def test_qwen_hub_config_translates_to_expected_model_config():
    got = model_config_from_hf(SHAPES["qwen_gqa2_dense0"])
    want = ModelConfig(
        family="qwen3_moe", num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
        num_query_groups=2, kv_channels=16, num_moe_experts=4, moe_ffn_hidden_size=24, moe_router_topk=2,
        moe_shared_expert_intermediate_size=None, moe_layer_freq=[0, 1], moe_router_score_function="softmax",
        moe_router_pre_softmax=False, moe_router_enable_expert_bias=False, moe_router_topk_scaling_factor=None,
        qk_layernorm=True, add_qkv_bias=False, layernorm_epsilon=1e-6, rotary_base=5000, rotary_percent=1.0,
        vocab_size=100, max_position_embeddings=256, untie_embeddings_and_output_weights=True,
        init_method_std=0.08, params_dtype="fp32")
    assert got == want


def test_glm_hub_config_translates_to_expected_model_config():
    got = model_config_from_hf(SHAPES["glm_gqa2_dense0_shared1"])
    want = ModelConfig(
        family="glm4_moe", num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
        num_query_groups=2, kv_channels=16, num_moe_experts=4, moe_ffn_hidden_size=24, moe_router_topk=2,
        moe_shared_expert_intermediate_size=24, moe_layer_freq=[0, 1], moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False, moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
        qk_layernorm=False, add_qkv_bias=True, layernorm_epsilon=1e-5, rotary_base=10000, rotary_percent=0.5,
        vocab_size=100, max_position_embeddings=256, untie_embeddings_and_output_weights=True,
        init_method_std=0.08, params_dtype="fp32")
    assert got == want


@pytest.mark.parametrize("name", list(SHAPES))
def test_transformers5_style_config_gives_the_same_model_config(name):
    assert model_config_from_hf(to_transformers5_style(SHAPES[name])) == model_config_from_hf(SHAPES[name])


def test_norm_topk_prob_maps_to_pre_softmax_and_tied_embeddings():
    cfg = model_config_from_hf(SHAPES["qwen_gqa3_nonorm_tied"])
    assert cfg.moe_router_pre_softmax is True and cfg.untie_embeddings_and_output_weights is False
    assert cfg.kv_channels is None and cfg.moe_layer_freq == 1


@pytest.mark.parametrize("name", list(SHAPES))
def test_generated_hf_config_round_trips_and_reads_the_same_in_transformers(name, tmp_path):
    from transformers import AutoConfig

    cfg = model_config_from_hf(SHAPES[name])
    generated = hf_config_from_model(cfg)
    assert model_config_from_hf(generated) == cfg
    (tmp_path / "config.json").write_text(json.dumps(generated))
    ours, ref = AutoConfig.from_pretrained(tmp_path), AutoConfig.from_pretrained(_write(tmp_path / "ref", SHAPES[name]))
    for key in ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "num_key_value_heads",
                "rope_parameters", "tie_word_embeddings", "norm_topk_prob", "rms_norm_eps"):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.head_dim == getattr(ref, "head_dim", ref.hidden_size // ref.num_attention_heads)
    for key in ("mlp_only_layers", "first_k_dense_replace", "n_shared_experts", "routed_scaling_factor",
                "attention_bias", "use_qk_norm"):
        if hasattr(ref, key) and key in SHAPES[name]:
            assert getattr(ours, key) == getattr(ref, key), key


def _write(path: pathlib.Path, cfg: dict) -> pathlib.Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("model_type, arch, needle", [
    ("deepseek_v2", "DeepseekV2ForCausalLM", "DeepSeek-V2"),
    ("llama", "LlamaForCausalLM", "not supported yet"),
    ("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2-MoE"),
])
def test_unsupported_architectures_are_one_clear_error(model_type, arch, needle):
    with pytest.raises(ConversionError, match=needle) as err:
        model_config_from_hf({"architectures": [arch], "model_type": model_type})
    assert "supported: Qwen3MoeForCausalLM" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("name, change, needle", [
    ("qwen_gqa2_dense0", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ("qwen_gqa2_dense0", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen_gqa2_dense0", {"attention_bias": True}, "attention_bias"),
    ("glm_gqa2_dense0_shared1", {"n_group": 4, "topk_group": 2}, "group-limited"),
    ("glm_gqa2_dense0_shared1", {"norm_topk_prob": False}, "norm_topk_prob"),
])
def test_unsupported_settings_are_rejected(name, change, needle):
    with pytest.raises(ConversionError, match=needle):
        model_config_from_hf({**SHAPES[name], **change})


def test_model_configs_a_family_cannot_express_are_rejected():
    qwen = model_config_from_hf(SHAPES["qwen_gqa2_dense0"])
    with pytest.raises(ConversionError, match="moe_router_enable_expert_bias"):
        hf_config_from_model(dataclasses.replace(qwen, moe_router_enable_expert_bias=True))
    glm = model_config_from_hf(SHAPES["glm_gqa2_dense0_shared1"])
    with pytest.raises(ConversionError, match="dense layers first"):
        hf_config_from_model(dataclasses.replace(glm, moe_layer_freq=[1, 0]))


def test_explicit_default_head_dim_is_the_same_architecture(tmp_path):
    """kv_channels = hidden/heads spelled out (tiny_moe.yaml) equals None, also after a config.json round trip;
    a different head dim is still a difference."""
    from sao_megatron.config import load_config
    from sao_megatron.models.families import architecture_diff

    model = load_config(pathlib.Path(__file__).resolve().parents[2] / "configs/experiments/tiny_cpu.yaml").model
    assert model.kv_channels == model.hidden_size // model.num_attention_heads  # spelled out in the YAML
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_model(model)))
    assert architecture_diff(model, model_config_from_hf(tmp_path)) == []
    assert architecture_diff(model, dataclasses.replace(model, kv_channels=None)) == []
    assert architecture_diff(model, dataclasses.replace(model, kv_channels=model.kv_channels * 2)) == [
        f"kv_channels: {model.kv_channels} vs {model.kv_channels * 2}"]


def test_family_lookup_by_architecture_then_model_type():
    assert family_for_hf({"architectures": ["Glm4MoeForCausalLM"]}).name == "glm4_moe"
    assert family_for_hf({"model_type": "qwen3_moe"}).name == "qwen3_moe"
    with pytest.raises(ConversionError, match="unknown model family"):
        get_family("mixtral")


# ------------------------------------------------------------------ transforms


def slow_qkv_reference(q, k, v, ng, d):
    """Megatron's fused QKV rows, built head by head: for each KV group, its query heads, then k, then v."""
    per_group = q.shape[0] // d // ng
    rows = []
    for g in range(ng):
        for h in range(per_group):
            head = g * per_group + h
            rows.append(q[head * d:(head + 1) * d])
        rows.append(k[g * d:(g + 1) * d])
        rows.append(v[g * d:(g + 1) * d])
    return torch.cat(rows)


@pytest.mark.parametrize("heads, groups, d", [(4, 2, 16), (6, 2, 8), (4, 4, 8), (8, 1, 4)])
def test_qkv_grouping_matches_head_by_head_reference(heads, groups, d):
    cfg = ModelConfig(hidden_size=32, num_attention_heads=heads, num_query_groups=groups, kv_channels=d)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * d, 32, generator=gen) for n in (heads, groups, groups))
    fused = base.qkv_to_mcore(cfg, [q, k, v])
    assert torch.equal(fused, slow_qkv_reference(q, k, v, groups, d))
    assert all(torch.equal(a, b) for a, b in zip(base.qkv_to_hf(cfg, fused), (q, k, v)))
    bias = base.qkv_to_mcore(cfg, [q[:, 0], k[:, 0], v[:, 0]])  # 1-D biases use the same layout
    assert torch.equal(bias, slow_qkv_reference(q, k, v, groups, d)[:, 0])


def test_gate_up_and_vocab_padding_transforms():
    cfg = model_config_from_hf(SHAPES["qwen_gqa2_dense0"])
    wmap = get_family("qwen3_moe").weight_map(cfg)
    gate, up = torch.randn(24, 32), torch.randn(24, 32)
    name = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    assert wmap.entry(name).hf == ("model.layers.1.mlp.experts.3.gate_proj.weight",
                                   "model.layers.1.mlp.experts.3.up_proj.weight")
    fc1 = wmap.to_mcore(name, [gate, up])
    assert torch.equal(fc1[:24], gate) and torch.equal(fc1[24:], up)
    emb = torch.randn(100, 32)
    padded = wmap.to_mcore("embedding.word_embeddings.weight", [emb], rows=128)
    assert padded.shape == (128, 32) and torch.equal(padded[:100], emb) and not padded[100:].any()
    (pair,) = wmap.to_hf("embedding.word_embeddings.weight", padded)
    assert pair[0] == "model.embed_tokens.weight" and torch.equal(pair[1], emb)


def test_weight_map_key_sets_follow_layer_kinds():
    glm = get_family("glm4_moe").weight_map(model_config_from_hf(SHAPES["glm_gqa2_dense0_shared1"]))
    names = set(glm.hf_names())
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names
    assert {"model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.shared_experts.up_proj.weight",
            "model.layers.1.self_attn.q_proj.bias", "model.layers.1.mlp.experts.3.down_proj.weight"} <= names
    assert not any("q_norm" in n for n in names)
    tied = get_family("qwen3_moe").weight_map(model_config_from_hf(SHAPES["qwen_gqa3_nonorm_tied"]))
    assert "lm_head.weight" not in tied.hf_names() and len(tied.hf_names()) == len(set(tied.hf_names()))
    with pytest.raises(ConversionError, match="no HF mapping"):
        tied.entry("decoder.layers.0.mlp.router.expert_bias")
