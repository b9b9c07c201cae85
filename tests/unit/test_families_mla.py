"""DeepSeek-V3 / GLM-5 config translation, the DSA skip-top-k schedule and the Hadamard CPU shim.

References: transformers' own config classes (defaults = the published GLM-5 and DeepSeek-V3
shapes, and how they read a config.json we generate), megatron-core's own
``is_dsa_skip_topk_layer``, and an explicit Sylvester Hadamard matrix.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import pytest
import torch

from sao_megatron.config.schema import ModelConfig
from sao_megatron.parallel.cpu_support import hadamard_rotate
from sao_megatron.models.families import ConversionError, hf_config_from_model, model_config_from_hf
from sao_megatron.models.families.base import dsa_runs_indexer
from sao_megatron.models.families.glm_moe_dsa import indexer_schedule

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "component" / "convert_scripts"))
from mla_fixtures import SHAPES  # noqa: E402

pytestmark = pytest.mark.unit


def sylvester(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("d", [1, 2, 8, 128])
def test_hadamard_rotate_is_the_orthonormal_sylvester_transform(d):
    x = torch.randn(3, 5, d, dtype=torch.float64, generator=torch.Generator().manual_seed(d))
    assert torch.allclose(hadamard_rotate(x), x @ sylvester(d) / d ** 0.5, atol=1e-12)
    q, k = torch.randn(4, d, dtype=torch.float64), torch.randn(6, d, dtype=torch.float64)
    assert torch.allclose(hadamard_rotate(q) @ hadamard_rotate(k).T, q @ k.T, atol=1e-10)
    assert hadamard_rotate(x.float()).dtype == torch.float32


def test_hadamard_rotate_rejects_a_non_power_of_two_dim():
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_rotate(torch.randn(2, 24))


@pytest.mark.parametrize("freq,offset", [(1, 0), (2, 0), (2, 1), (2, 3), (3, 2), (4, 5)])
def test_indexer_schedule_matches_megatron_and_transformers(freq, offset):
    from megatron.core.transformer.experimental_attention_variant.dsa import is_dsa_skip_topk_layer
    from transformers import GlmMoeDsaConfig

    n = 12
    cfg = ModelConfig(num_layers=n, dsa_indexer_topk_freq=freq, dsa_indexer_skip_topk_offset=offset)
    ours = ["full" if dsa_runs_indexer(cfg, i) else "shared" for i in range(n)]
    megatron = ["shared" if freq > 1 and is_dsa_skip_topk_layer(i + 1, offset, freq) else "full" for i in range(n)]
    assert ours == megatron
    if offset >= 1:  # transformers' formula; offset 0 behaves like 1 in Megatron
        hf = GlmMoeDsaConfig(num_hidden_layers=n, index_topk_freq=freq, index_skip_topk_offset=offset)
        assert ours == hf.indexer_types
    f2, o2 = indexer_schedule(ours, "x")
    again = ModelConfig(num_layers=n, dsa_indexer_topk_freq=f2, dsa_indexer_skip_topk_offset=o2)
    assert ["full" if dsa_runs_indexer(again, i) else "shared" for i in range(n)] == ours


def test_a_non_periodic_indexer_pattern_is_refused():
    with pytest.raises(ConversionError, match="periodic"):
        indexer_schedule(["full", "shared", "shared", "full", "shared", "full"], "config.json")


def test_published_glm5_config_translates_to_megatron_fields():
    from transformers import GlmMoeDsaConfig

    hf = GlmMoeDsaConfig().to_dict() | {"architectures": ["GlmMoeDsaForCausalLM"], "num_nextn_predict_layers": 1}
    cfg = model_config_from_hf(hf)
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_moe_experts, cfg.moe_router_topk) == (
        "glm_moe_dsa", 78, 6144, 256, 8)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == (
        2048, 512, 192, 64, 256)
    assert (cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim, cfg.dsa_indexer_topk) == (32, 128, 2048)
    assert cfg.moe_layer_freq == [0, 0, 0] + [1] * 75 and cfg.moe_shared_expert_intermediate_size == 2048
    assert cfg.moe_router_topk_scaling_factor == 2.5 and cfg.mtp_num_layers == 1


def test_published_deepseek_v3_config_carries_groups_and_yarn():
    from transformers import DeepseekV3Config

    yarn = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    hf = DeepseekV3Config().to_dict() | {"architectures": ["DeepseekV3ForCausalLM"], "rope_scaling": yarn,
                                         "rope_parameters": None, "rope_theta": 10000}
    cfg = model_config_from_hf(hf)
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (8, 4)
    assert (cfg.rope_type, cfg.rotary_scaling_factor, cfg.mscale_all_dim) == ("yarn", 40.0, 1.0)
    assert cfg.experimental_attention_variant is None and cfg.num_layers == 61


@pytest.mark.parametrize("name", list(SHAPES))
def test_generated_config_json_reads_back_the_same_in_us_and_transformers(name):
    from transformers import AutoConfig

    cfg = model_config_from_hf(SHAPES[name])
    hub = hf_config_from_model(cfg)
    assert model_config_from_hf(hub) == cfg
    ours = AutoConfig.for_model(hub["model_type"], **{k: v for k, v in hub.items() if k != "model_type"})
    ref = AutoConfig.for_model(SHAPES[name]["model_type"],
                               **{k: v for k, v in SHAPES[name].items() if k != "model_type"})
    for key in ("q_lora_rank", "kv_lora_rank", "n_group", "topk_group", "first_k_dense_replace", "rope_parameters",
                "index_topk", "indexer_types", "routed_scaling_factor", "mlp_layer_types"):
        assert getattr(ours, key, None) == getattr(ref, key, None), key


def test_group_limited_routing_other_than_top2_per_group_is_refused():
    hub = dict(SHAPES["dsv3_yarn_groups_mtp"], num_experts_per_tok=2)
    with pytest.raises(ConversionError, match="topk_group"):
        model_config_from_hf(hub)


def test_dsa_model_cannot_be_written_as_deepseek_v3():
    cfg = dataclasses.replace(model_config_from_hf(SHAPES["glm5_full_idx"]), family="deepseek_v3")
    with pytest.raises(ConversionError, match="glm_moe_dsa"):
        hf_config_from_model(cfg)


def test_critic_frozen_attention_covers_mla_and_the_indexer():
    """Every mapped tensor under self_attention (latent projections, norms, indexer) is 'attention'."""
    from sao_megatron.models.critic import param_group
    from sao_megatron.models.families import get_family

    cfg = model_config_from_hf(SHAPES["glm5_shared_idx_mtp"])
    names = [e.mcore for e in get_family("glm_moe_dsa").weight_map(cfg).entries if ".self_attention." in e.mcore]
    assert any(".indexer." in n for n in names) and any("kv_layernorm" in n for n in names)
    assert {param_group(n) for n in names} == {"attention"}
