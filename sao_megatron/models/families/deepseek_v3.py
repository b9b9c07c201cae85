"""DeepSeek-V3 (transformers ``DeepseekV3ForCausalLM``): MLA attention, DeepSeek MoE with group-limited routing.

The mapping and config translation shared with GLM-5 live in ``families/mla.py``;
DeepSeek-V3 adds YaRN rope scaling (``rope_scaling.type = yarn``, carried into
Megatron's ``rope_type="yarn"`` fields) and ``n_group``/``topk_group``
(Megatron's ``moe_router_num_groups``/``moe_router_group_topk``).
"""

from __future__ import annotations

from typing import Any

from sao_megatron.config.schema import ModelConfig
from sao_megatron.models.families import base as b
from sao_megatron.models.families import mla
from sao_megatron.models.families.hf_config import HfConfigView

RULES: tuple[b.Rule, ...] = (b.EMBEDDING, *mla.MLA_ATTENTION, *mla.MOE_BLOCK, b.FINAL_NORM, b.LM_HEAD)


def config_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    return ModelConfig(family="deepseek_v3", **mla.mla_model_fields(HfConfigView(hf, source)))


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    mla.check_mla_expressible(cfg, "deepseek_v3")
    if cfg.experimental_attention_variant is not None:
        raise b.ConversionError("model.experimental_attention_variant='dsa' cannot be expressed as an HF "
                                "deepseek_v3 model (use family glm_moe_dsa)")
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **mla.mla_hf_fields(cfg),
            "rope_interleave": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc"}


FAMILY = b.Family(
    name="deepseek_v3", architectures=("DeepseekV3ForCausalLM",), model_types=("deepseek_v3",), rules=RULES,
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, fp32_hf_names=mla.FP32_HF_NAMES,
    is_ignored_hf=mla.is_ignored_hf,
)
