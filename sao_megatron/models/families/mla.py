"""Shared by the multi-head-latent-attention families (DeepSeek-V3, GLM-5): weight rules and config reading.

HF ``DeepseekV3Attention`` / ``GlmMoeDsaAttention`` and Megatron's MLA keep
the same tensor layouts, so every attention tensor is a plain copy:

| HF (model.layers.N.self_attn.)  | Megatron (decoder.layers.N.self_attention.) |
|---|---|
| q_a_proj [q_lora, H]            | linear_q_down_proj                        |
| q_a_layernorm [q_lora]          | q_layernorm                               |
| q_b_proj [nh*(nope+rope), q_lora] | linear_q_up_proj (per head [nope; rope]) |
| kv_a_proj_with_mqa [kv_lora+rope, H] | linear_kv_down_proj ([latent; rope]) |
| kv_a_layernorm [kv_lora]        | kv_layernorm                              |
| kv_b_proj [nh*(nope+v), kv_lora] | linear_kv_up_proj (per head [k_nope; v]) |
| o_proj [H, nh*v]                | linear_proj                               |
| indexer.wq_b / wk / k_norm / weights_proj | core_attention.indexer.linear_wq_b / linear_wk / k_norm / linear_weights_proj |

RoPE: both sides rotate interleaved pairs (HF ``rope_interleave``; Megatron's
MLA always de-interleaves before rotating, which permutes q and k alike and
leaves q.k unchanged). The MoE block is DeepSeek's: sigmoid scores plus the
``e_score_correction_bias`` for choosing, renormalised top-k weights times
``routed_scaling_factor``, group-limited routing (``n_group``/``topk_group``),
one shared expert, ``first_k_dense_replace`` dense layers first.

Multi-token-prediction layers (``num_nextn_predict_layers``, stored as layers
``num_hidden_layers + i``) are not part of the Megatron model: the converter
keeps their tensors aside and writes them back unchanged on export
(``checkpoints_tools/mtp.py``); the trainer never updates them.
"""

from __future__ import annotations

import re
from typing import Any

from sao_megatron.config.schema import ModelConfig
from sao_megatron.models.families import base as b
from sao_megatron.models.families.hf_config import HfConfigView, check_expressible, common_model_fields

_ML, _HL = "decoder.layers.{L}.self_attention.", "model.layers.{L}.self_attn."
_IDX_M, _IDX_H = _ML + "core_attention.indexer.", _HL + "indexer."
MLA_ATTENTION = (
    b.rule("decoder.layers.{L}.input_layernorm.weight", "model.layers.{L}.input_layernorm.weight", ("H",)),
    b.rule(_ML + "linear_q_down_proj.weight", _HL + "q_a_proj.weight", ("QL", "H"), when=(b.Q_LORA,)),
    b.rule(_ML + "q_layernorm.weight", _HL + "q_a_layernorm.weight", ("QL",), when=(b.Q_LORA,)),
    b.rule(_ML + "linear_q_up_proj.weight", _HL + "q_b_proj.weight", ("QH", "QL"), when=(b.Q_LORA,)),
    b.rule(_ML + "linear_kv_down_proj.weight", _HL + "kv_a_proj_with_mqa.weight", ("KVA", "H")),
    b.rule(_ML + "kv_layernorm.weight", _HL + "kv_a_layernorm.weight", ("KVL",)),
    b.rule(_ML + "linear_kv_up_proj.weight", _HL + "kv_b_proj.weight", ("KVB", "KVL")),
    b.rule(_ML + "linear_proj.weight", _HL + "o_proj.weight", ("H", "O")),
    b.rule("decoder.layers.{L}.pre_mlp_layernorm.weight", "model.layers.{L}.post_attention_layernorm.weight",
           ("H",)),
)
DSA_INDEXER = (
    b.rule(_IDX_M + "linear_wq_b.weight", _IDX_H + "wq_b.weight", ("IQ", "QL"), when=(b.INDEXER,)),
    b.rule(_IDX_M + "linear_wk.weight", _IDX_H + "wk.weight", ("ID", "H"), when=(b.INDEXER,)),
    b.rule(_IDX_M + "k_norm.weight", _IDX_H + "k_norm.weight", ("ID",), when=(b.INDEXER,)),
    b.rule(_IDX_M + "k_norm.bias", _IDX_H + "k_norm.bias", ("ID",), when=(b.INDEXER,)),
    b.rule(_IDX_M + "linear_weights_proj.weight", _IDX_H + "weights_proj.weight", ("IN", "H"), when=(b.INDEXER,)),
)
MOE_BLOCK = (*b.DENSE_MLP, *b.ROUTED_EXPERTS, b.ROUTER_EXPERT_BIAS, *b.SHARED_EXPERT)
FP32_HF_NAMES = (r"model\.layers\.\d+\.mlp\.gate\.e_score_correction_bias",)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_YARN_KEYS = {"rotary_scaling_factor": ("factor", 1.0), "original_max_position_embeddings":
              ("original_max_position_embeddings", 4096), "beta_fast": ("beta_fast", 32.0),
              "beta_slow": ("beta_slow", 1.0), "mscale": ("mscale", 1.0), "mscale_all_dim": ("mscale_all_dim", 0.0)}


def rope_fields(c: HfConfigView) -> dict[str, Any]:
    """rope_type, rotary_base and the YaRN fields from ``rope_parameters`` / ``rope_scaling``."""
    params = dict(c.hf.get("rope_scaling") or {}) | dict(c.hf.get("rope_parameters") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    c.require(rope_type in ("default", "yarn"), f"rope type '{rope_type}' for MLA (only default and yarn)")
    theta = float(params.get("rope_theta", c.hf.get("rope_theta", 10000.0)))
    c.require(theta.is_integer(), f"non-integer rope_theta={theta}")
    c.require(float(params.get("partial_rotary_factor", 1.0)) == 1.0, "partial_rotary_factor != 1 with MLA")
    out: dict[str, Any] = {"rotary_base": int(theta), "rotary_percent": 1.0, "rope_type": "rope"}
    if rope_type == "yarn":
        out["rope_type"] = "yarn"
        for field, (key, default) in _YARN_KEYS.items():
            out[field] = type(default)(params.get(key, default))
        c.require(params.get("truncate", True) is not False, "yarn with truncate=false")
    return out


def moe_fields(c: HfConfigView, num_layers: int, topk: int) -> dict[str, Any]:
    """DeepSeek MoE block: sigmoid router + expert bias, group-limited routing, shared expert, dense layers."""
    c.require(c.get("scoring_func", default="sigmoid") == "sigmoid", "scoring_func other than sigmoid")
    c.require(c.get("topk_method", default="noaux_tc") == "noaux_tc", "topk_method other than noaux_tc")
    c.require(c.get("norm_topk_prob", default=True) or topk == 1,
              "norm_topk_prob=false with the sigmoid router (Megatron always renormalises)")
    groups, group_topk = c.get("n_group", default=1), c.get("topk_group", default=1)
    if groups > 1:
        # HF scores a group by the sum of its top-2 experts; Megatron by its top (topk // topk_group).
        c.require(topk // group_topk == 2, f"num_experts_per_tok // topk_group != 2 (got {topk}//{group_topk})")
    layer_types = c.get("mlp_layer_types", default=None)
    if layer_types is not None:
        freq = [int(t == "sparse") for t in layer_types]
    else:
        first_dense = c.get("first_k_dense_replace", default=0)
        freq = [int(i >= first_dense) for i in range(num_layers)]
    moe_ffn = c.get("moe_intermediate_size")
    scale = float(c.get("routed_scaling_factor", default=1.0))
    return dict(
        num_moe_experts=c.get("n_routed_experts", "num_local_experts", "num_experts"),
        moe_layer_freq=1 if all(freq) else freq,
        moe_shared_expert_intermediate_size=c.get("n_shared_experts", default=1) * moe_ffn or None,
        moe_router_score_function="sigmoid", moe_router_pre_softmax=False, moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=None if scale == 1.0 else scale,
        moe_router_num_groups=groups if groups > 1 else None, moe_router_group_topk=group_topk if groups > 1 else None,
    )


def mla_model_fields(c: HfConfigView) -> dict[str, Any]:
    """Every ModelConfig field of a DeepSeek-style MLA MoE model except ``family`` and DSA."""
    fields = common_model_fields(c)
    c.require(not c.get("attention_bias", default=False), "attention_bias=true with MLA")
    c.require(c.get("rope_interleave", default=True), "rope_interleave=false")
    # Megatron's MLA without q LoRA fuses a q norm into linear_q_proj, which HF's q_proj lacks.
    c.require(c.get("q_lora_rank", default=None) is not None, "q_lora_rank=null (DeepSeek-V2-Lite style q_proj)")
    mtp = c.get("num_nextn_predict_layers", default=0)
    fields |= dict(num_query_groups=fields["num_attention_heads"], kv_channels=None, normalization="RMSNorm",
                   qk_layernorm=True, add_qkv_bias=False, multi_latent_attention=True,
                   q_lora_rank=c.get("q_lora_rank", default=None), kv_lora_rank=c.get("kv_lora_rank"),
                   qk_head_dim=c.get("qk_nope_head_dim"), qk_pos_emb_head_dim=c.get("qk_rope_head_dim"),
                   v_head_dim=c.get("v_head_dim"), mtp_num_layers=mtp or None)
    return fields | rope_fields(c) | moe_fields(c, fields["num_layers"], fields["moe_router_topk"])


def check_mla_expressible(cfg: ModelConfig, family: str) -> None:
    check_expressible(cfg, family, multi_latent_attention=True, moe_router_score_function="sigmoid",
                      moe_router_enable_expert_bias=True, moe_router_pre_softmax=False, normalization="RMSNorm",
                      qk_layernorm=True, add_qkv_bias=False, rotary_percent=1.0)
    if cfg.num_moe_experts is None or cfg.moe_ffn_hidden_size is None:
        raise b.ConversionError(f"model.num_moe_experts=None (dense) cannot be expressed as an HF {family} model")
    shared = cfg.moe_shared_expert_intermediate_size or 0
    if shared % cfg.moe_ffn_hidden_size:
        raise b.ConversionError(f"model.moe_shared_expert_intermediate_size={shared} must be a multiple of "
                                f"model.moe_ffn_hidden_size={cfg.moe_ffn_hidden_size} for {family}")


def mla_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """Hub-style config.json keys of a DeepSeek-style MLA MoE model."""
    moe = [b.is_moe_layer(cfg, i) for i in range(cfg.num_layers)]
    rope = {"rope_type": "yarn", "type": "yarn", **{key: getattr(cfg, f) for f, (key, _) in _YARN_KEYS.items()}}
    from sao_megatron.models.families.hf_config import dtype_name

    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.layernorm_epsilon,
        "rope_theta": float(cfg.rotary_base), **({"rope_scaling": rope} if cfg.rope_type == "yarn" else {}),
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights, "initializer_range": cfg.init_method_std,
        "torch_dtype": dtype_name(cfg.params_dtype), "use_cache": True, "attention_bias": False,
        "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_head_dim,
        "qk_rope_head_dim": cfg.qk_pos_emb_head_dim, "v_head_dim": cfg.v_head_dim,
        "moe_intermediate_size": cfg.moe_ffn_hidden_size, "num_experts_per_tok": cfg.moe_router_topk,
        "n_routed_experts": cfg.num_moe_experts,
        "n_shared_experts": (cfg.moe_shared_expert_intermediate_size or 0) // cfg.moe_ffn_hidden_size,
        "first_k_dense_replace": moe.index(True) if True in moe else cfg.num_layers,
        "norm_topk_prob": True, "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0,
        "n_group": cfg.moe_router_num_groups or 1, "topk_group": cfg.moe_router_group_topk or 1,
        "num_nextn_predict_layers": cfg.mtp_num_layers or 0,
    }


def is_ignored_hf(hf_name: str, cfg: ModelConfig) -> bool:
    """MTP layers (kept aside by the converter); zero-size shared-expert tensors when n_shared_experts=0."""
    m = _LAYER.match(hf_name)
    if m and int(m.group(1)) >= cfg.num_layers:
        return True
    return cfg.moe_shared_expert_intermediate_size is None and ".mlp.shared_experts." in hf_name
