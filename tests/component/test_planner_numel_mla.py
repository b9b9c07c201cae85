"""Parameter counts of the MLA/DSA families: the planner equals real Megatron numel, and the published totals.

Tiny GLM-5- and DeepSeek-V3-shaped models are built on CPU (actor and critic, per critic group).
The full-size models are built on the meta device one layer of each kind (dense/MoE x indexer
full/shared) and each kind's numel times its count, plus embedding, final norm and LM head,
must give GLM-5's 743.9B and DeepSeek-V3's 671.0B (the totals transformers reports).
"""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from sao_megatron.config import ModelConfig, load_config
from sao_megatron.launch.planner import count_params

from tests.component.test_planner_numel import local_group_numel

pytestmark = pytest.mark.component
ROOT = pathlib.Path(__file__).resolve().parents[2]

_TINY_MLA = dict(num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=4,
                 kv_channels=None, num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
                 moe_shared_expert_intermediate_size=16, moe_layer_freq=[0, 1, 1, 1],
                 moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, qk_layernorm=True,
                 vocab_size=96, max_position_embeddings=64, multi_latent_attention=True, q_lora_rank=24,
                 kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=12)
TINY = {
    "deepseek_v3": ModelConfig(family="deepseek_v3", **_TINY_MLA, moe_router_num_groups=2, moe_router_group_topk=1,
                               rope_type="yarn", rotary_scaling_factor=4.0),
    "glm_moe_dsa": ModelConfig(family="glm_moe_dsa", **_TINY_MLA, experimental_attention_variant="dsa",
                               dsa_indexer_n_heads=4, dsa_indexer_head_dim=16, dsa_indexer_topk=8,
                               dsa_indexer_topk_freq=2, dsa_indexer_skip_topk_offset=1,
                               dsa_indexer_rope_interleaved=True),
}
PUBLISHED = {"glm-5-744b-a40b": 743.9e9, "deepseek-v3-671b": 671.0e9}


@pytest.fixture(scope="module")
def ctx(megatron_ctx):
    """Megatron in this process for this module only (see conftest.megatron_ctx)."""
    return megatron_ctx


@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("critic", [False, True], ids=["actor", "critic"])
def test_planner_equals_megatron_numel_for_tiny_mla_models(ctx, name, critic):
    from sao_megatron.models.builder import build_model_chunks

    chunks = build_model_chunks(TINY[name], ctx, value_head=critic)
    assert count_params(TINY[name], critic=critic).groups == local_group_numel(chunks, critic=critic)


def layer_kind_numel(model: ModelConfig, ctx) -> dict[tuple[bool, bool], int]:
    """numel of one layer per (moe, runs_indexer) kind, each built on the meta device (2-layer models)."""
    import torch

    from sao_megatron.models.builder import build_model_chunks
    from sao_megatron.models.mla_sizes import runs_indexer

    kinds = {}
    shared = model.experimental_attention_variant == "dsa"
    for moe in (False, True):
        # layer 2 (1-based) of a freq-2/offset-1 schedule reuses layer 1's top-k: no indexer.
        small = dataclasses.replace(model, num_layers=2, moe_layer_freq=[int(moe)] * 2,
                                    **({"dsa_indexer_topk_freq": 2, "dsa_indexer_skip_topk_offset": 1}
                                       if shared else {}))
        with torch.device("meta"):
            (chunk,) = build_model_chunks(small, ctx)
        for i, layer in enumerate(chunk.decoder.layers):
            kinds[(moe, runs_indexer(small, i) or not shared)] = sum(p.numel() for p in layer.parameters())
    return kinds


@pytest.mark.parametrize("config", list(PUBLISHED))
def test_full_size_numel_equals_the_published_total(ctx, config):
    from sao_megatron.models.mla_sizes import runs_indexer
    from sao_megatron.launch.planner import moe_layer_mask

    model = load_config(ROOT / f"configs/models/{config}.yaml").model
    kinds = layer_kind_numel(model, ctx)
    dsa = model.experimental_attention_variant == "dsa"
    layers = sum(kinds[(moe, runs_indexer(model, i) or not dsa)] for i, moe in enumerate(moe_layer_mask(model)))
    total = layers + 2 * model.vocab_size * model.hidden_size + model.hidden_size  # embedding, LM head, final norm
    assert round(total / 1e8) == round(PUBLISHED[config] / 1e8)
    assert total == count_params(model, divisible_by=1).total
