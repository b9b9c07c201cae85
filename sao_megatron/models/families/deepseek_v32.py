"""DeepSeek-V3.2 (transformers ``DeepseekV32ForCausalLM``, model_type ``deepseek_v32``): DeepSeek-V3 + DSA.

The same tensors and mapping as GLM-5 (``glm_moe_dsa.py``): DeepSeek-V3's MLA and MoE plus a
DeepSeek sparse-attention indexer (``wq_b``, ``wk``, ``k_norm``, ``weights_proj``) in every
layer. Two differences: every layer runs its own indexer (no ``indexer_types``, no shared
layers), and the indexer rotates its rope part **half-split** (``rotate_half``) instead of in
interleaved pairs (Megatron: ``dsa_indexer_rope_interleaved=false``); the main MLA attention
still rotates interleaved pairs.
"""

from __future__ import annotations

from typing import Any

from sao_megatron.config.schema import ModelConfig
from sao_megatron.models.families import base as b
from sao_megatron.models.families import mla
from sao_megatron.models.families.glm_moe_dsa import INDEXER_K_NORM_EPS, RULES
from sao_megatron.models.families.hf_config import HfConfigView


def config_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    c = HfConfigView(hf, source)
    fields = mla.mla_model_fields(c)
    c.require(fields["q_lora_rank"] is not None, "q_lora_rank=null with DSA")
    return ModelConfig(
        family="deepseek_v32", **fields, experimental_attention_variant="dsa",
        dsa_indexer_n_heads=c.get("index_n_heads"), dsa_indexer_head_dim=c.get("index_head_dim"),
        dsa_indexer_topk=c.get("index_topk"), dsa_indexer_topk_freq=1, dsa_indexer_skip_topk_offset=0,
        dsa_indexer_rope_interleaved=False, dsa_indexer_k_norm_epsilon=INDEXER_K_NORM_EPS,
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    mla.check_mla_expressible(cfg, "deepseek_v32")
    if (cfg.experimental_attention_variant != "dsa" or cfg.dsa_indexer_rope_interleaved
            or any(not b.dsa_runs_indexer(cfg, i) for i in range(cfg.num_layers))):
        raise b.ConversionError("deepseek_v32 needs model.experimental_attention_variant='dsa', "
                                "model.dsa_indexer_rope_interleaved=false and an indexer in every layer "
                                "(dsa_indexer_topk_freq=1)")
    return {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", **mla.mla_hf_fields(cfg),
            "index_n_heads": cfg.dsa_indexer_n_heads, "index_head_dim": cfg.dsa_indexer_head_dim,
            "index_topk": cfg.dsa_indexer_topk,
            "mlp_layer_types": ["sparse" if b.is_moe_layer(cfg, i) else "dense" for i in range(cfg.num_layers)]}


FAMILY = b.Family(
    name="deepseek_v32", architectures=("DeepseekV32ForCausalLM",), model_types=("deepseek_v32",), rules=RULES,
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, fp32_hf_names=mla.FP32_HF_NAMES,
    is_ignored_hf=mla.is_ignored_hf,
)
