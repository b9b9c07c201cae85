"""GLM-4.5-style MoE (transformers ``Glm4MoeForCausalLM``).

Differences from Qwen3-MoE: sigmoid router scores with an aux-loss-free
expert bias (``e_score_correction_bias``) used only to choose the experts,
top-k weights renormalised then scaled by ``routed_scaling_factor``; one
shared expert of ``n_shared_experts * moe_intermediate_size`` (no gate);
the first ``first_k_dense_replace`` layers are dense; q/k/v biases
(``attention_bias``), partial rotary (``partial_rotary_factor``, 0.5 when
absent, as transformers assumes), optional q/k norm (``use_qk_norm``).
Multi-token-prediction layers (``num_nextn_predict_layers``, stored as
layers ``num_hidden_layers + i``) are not part of the Megatron model and
are skipped on import.
"""

from __future__ import annotations

import re
from typing import Any

from sao_megatron.config.schema import ModelConfig
from sao_megatron.models.families import base as b
from sao_megatron.models.families.hf_config import (
    HfConfigView, check_expressible, common_hf_fields, common_model_fields,
)

RULES: tuple[b.Rule, ...] = (
    b.EMBEDDING, *b.ATTENTION, b.QKV_BIASES, *b.QK_NORMS, *b.DENSE_MLP, *b.ROUTED_EXPERTS,
    b.ROUTER_EXPERT_BIAS, *b.SHARED_EXPERT, b.FINAL_NORM, b.LM_HEAD,
)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def config_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    c = HfConfigView(hf, source)
    fields = common_model_fields(c)
    num_experts = c.get("n_routed_experts", "num_local_experts", "num_experts")
    c.require(c.get("n_group", default=1) == c.get("topk_group", default=1),
              "group-limited routing (n_group != topk_group)")
    c.require(c.get("norm_topk_prob", default=True) or fields["moe_router_topk"] == 1,
              "norm_topk_prob=false with the sigmoid router (Megatron always renormalises)")
    theta, partial = c.rope_base(default_partial=0.5)
    first_dense = c.get("first_k_dense_replace", default=1)
    num_shared = c.get("n_shared_experts", default=1)
    freq = [int(i >= first_dense) for i in range(fields["num_layers"])]
    scale = float(c.get("routed_scaling_factor", default=1.0))
    return ModelConfig(
        family="glm4_moe", **fields, num_moe_experts=num_experts, moe_layer_freq=1 if all(freq) else freq,
        moe_shared_expert_intermediate_size=num_shared * fields["moe_ffn_hidden_size"] or None,
        moe_router_score_function="sigmoid", moe_router_pre_softmax=False, moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=None if scale == 1.0 else scale,
        qk_layernorm=bool(c.get("use_qk_norm", default=False)), add_qkv_bias=bool(c.get("attention_bias", default=False)),
        normalization="RMSNorm", rotary_base=theta, rotary_percent=partial,
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    check_expressible(cfg, "glm4_moe", moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                      moe_router_pre_softmax=False, normalization="RMSNorm")
    if cfg.num_moe_experts is None or cfg.moe_ffn_hidden_size is None:
        raise b.ConversionError("model.num_moe_experts=None (dense) cannot be expressed as an HF glm4_moe model")
    moe = [b.is_moe_layer(cfg, i) for i in range(cfg.num_layers)]
    first_dense = moe.index(True) if True in moe else cfg.num_layers
    if any(not m for m in moe[first_dense:]):
        raise b.ConversionError(f"model.moe_layer_freq={cfg.moe_layer_freq}: glm4_moe needs dense layers first, "
                                "then only MoE layers (first_k_dense_replace)")
    shared = cfg.moe_shared_expert_intermediate_size or 0
    if shared % cfg.moe_ffn_hidden_size:
        raise b.ConversionError(f"model.moe_shared_expert_intermediate_size={shared} must be a multiple of "
                                f"model.moe_ffn_hidden_size={cfg.moe_ffn_hidden_size} for glm4_moe")
    return {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", **common_hf_fields(cfg),
        "n_routed_experts": cfg.num_moe_experts, "n_shared_experts": shared // cfg.moe_ffn_hidden_size,
        "first_k_dense_replace": first_dense, "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0, "use_qk_norm": cfg.qk_layernorm,
        "attention_bias": cfg.add_qkv_bias, "partial_rotary_factor": cfg.rotary_percent,
        "num_nextn_predict_layers": 0,
    }


def _is_ignored(hf_name: str, cfg: ModelConfig) -> bool:
    """MTP layers; the zero-size shared-expert tensors transformers writes when n_shared_experts=0."""
    m = _LAYER.match(hf_name)
    if m and int(m.group(1)) >= cfg.num_layers:
        return True
    return cfg.moe_shared_expert_intermediate_size is None and ".mlp.shared_experts." in hf_name


FAMILY = b.Family(
    name="glm4_moe", architectures=("Glm4MoeForCausalLM",), model_types=("glm4_moe",), rules=RULES,
    config_from_hf=config_from_hf, config_to_hf=config_to_hf,
    fp32_hf_names=(r"model\.layers\.\d+\.mlp\.gate\.e_score_correction_bias",), is_ignored_hf=_is_ignored,
)
