"""Qwen3-MoE (e.g. Qwen3-30B-A3B): softmax top-k router, q/k RMSNorm, no shared expert.

HF semantics (transformers ``Qwen3MoeForCausalLM``): layer ``i`` is MoE iff
``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``;
``norm_topk_prob`` renormalises the top-k softmax probabilities, which is
Megatron's top-k-then-softmax (``moe_router_pre_softmax=False``); without it
the probabilities are the full softmax (``moe_router_pre_softmax=True``).
"""

from __future__ import annotations

from typing import Any

from sao_megatron.config.schema import ModelConfig
from sao_megatron.models.families import base as b
from sao_megatron.models.families.hf_config import (
    HfConfigView, check_expressible, common_hf_fields, common_model_fields,
)

RULES: tuple[b.Rule, ...] = (
    b.EMBEDDING, *b.ATTENTION, *b.QK_NORMS, *b.DENSE_MLP, *b.ROUTED_EXPERTS, b.FINAL_NORM, b.LM_HEAD,
)


def config_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    c = HfConfigView(hf, source)
    fields = common_model_fields(c)
    num_experts = c.get("num_experts", "num_local_experts")
    c.require(num_experts > 0, "num_experts=0 (a dense Qwen3 model)")
    c.require(not c.get("use_sliding_window", default=False), "use_sliding_window=true")
    c.require(not c.get("attention_bias", default=False), "attention_bias=true (Qwen3 puts it on o_proj too)")
    theta, partial = c.rope_base()
    c.require(partial == 1.0, f"partial_rotary_factor={partial} for qwen3_moe")
    step, mlp_only = c.get("decoder_sparse_step", default=1), set(c.get("mlp_only_layers", default=[]))
    freq = [int(i not in mlp_only and (i + 1) % step == 0) for i in range(fields["num_layers"])]
    return ModelConfig(
        family="qwen3_moe", **fields, num_moe_experts=num_experts, moe_layer_freq=1 if all(freq) else freq,
        moe_shared_expert_intermediate_size=None, moe_router_score_function="softmax",
        moe_router_pre_softmax=not c.get("norm_topk_prob", default=False), moe_router_enable_expert_bias=False,
        moe_router_topk_scaling_factor=None, qk_layernorm=True, add_qkv_bias=False, normalization="RMSNorm",
        rotary_base=theta, rotary_percent=1.0,
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    check_expressible(cfg, "qwen3_moe", qk_layernorm=True, add_qkv_bias=False, rotary_percent=1.0,
                      moe_router_score_function="softmax", moe_router_enable_expert_bias=False,
                      moe_shared_expert_intermediate_size=None, moe_router_topk_scaling_factor=None,
                      normalization="RMSNorm")
    if cfg.num_moe_experts is None:
        raise b.ConversionError("model.num_moe_experts=None (dense) cannot be expressed as an HF qwen3_moe model")
    dense = [i for i in range(cfg.num_layers) if not b.is_moe_layer(cfg, i)]
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common_hf_fields(cfg),
        "num_experts": cfg.num_moe_experts, "norm_topk_prob": not cfg.moe_router_pre_softmax,
        "decoder_sparse_step": 1, "mlp_only_layers": dense, "attention_bias": False,
        "use_sliding_window": False, "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
    }


FAMILY = b.Family(
    name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",), model_types=("qwen3_moe",), rules=RULES,
    config_from_hf=config_from_hf, config_to_hf=config_to_hf,
)
