"""Supported HF model families: config translation and the declarative weight mappings.

Public API::

    model_config_from_hf(hf_dir_or_config) -> ModelConfig
    hf_config_from_model(model_cfg) -> dict            # hub-style config.json
    write_hf_template(model_cfg, tokenizer, out_dir)   # config.json (+ tokenizer) of an export dir
    architecture_diff(a, b) -> list[str]               # fields on which two ModelConfigs disagree
    family_for_hf(hf_config, source) -> Family
    get_family(name) -> Family                         # Family.weight_map(cfg) -> WeightMap
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from sao_megatron.config.schema import ModelConfig
from sao_megatron.models import arch
from sao_megatron.models.families import deepseek_v3, deepseek_v32, glm4_moe, glm_moe_dsa, qwen3_moe
from sao_megatron.models.families.base import ConversionError, Family, WeightMap
from sao_megatron.models.families.hf_config import read_hf_config

__all__ = ["ConversionError", "FAMILIES", "Family", "WeightMap", "architecture_diff", "family_for_hf", "get_family",
           "hf_config_from_model", "model_config_from_hf", "write_hf_template"]

FAMILIES: dict[str, Family] = {f.name: f for f in (qwen3_moe.FAMILY, glm4_moe.FAMILY, deepseek_v3.FAMILY,
                                                   glm_moe_dsa.FAMILY, deepseek_v32.FAMILY)}

# Families we know of but do not convert yet (the reason is part of the error message).
_NOT_YET = {
    "deepseek_v2": "DeepSeek-V2 (MLA attention) is not supported yet",
    "kimi_k2": "Kimi-K2 (DeepSeek-V3 architecture, MLA) is not supported yet",
    "qwen2_moe": "Qwen2-MoE (gated shared expert) is not supported yet",
    "mixtral": "Mixtral is not supported yet",
}


def get_family(name: str) -> Family:
    """The family registered under ``ModelConfig.family``."""
    if name not in FAMILIES:
        raise ConversionError(f"unknown model family '{name}'; supported: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_for_hf(hf: dict[str, Any], source: str = "config.json") -> Family:
    """The family of an HF config dict (by ``architectures``, then ``model_type``)."""
    archs, model_type = list(hf.get("architectures") or []), hf.get("model_type")
    for fam in FAMILIES.values():
        if set(archs) & set(fam.architectures) or (not archs and model_type in fam.model_types):
            return fam
    supported = ", ".join(f"{f.architectures[0]} ({f.name})" for f in FAMILIES.values())
    reason = _NOT_YET.get(str(model_type), "is not supported yet")
    raise ConversionError(f"{source}: architecture {archs or '?'} (model_type '{model_type}'): {reason}; "
                          f"supported: {supported}")


def model_config_from_hf(hf: str | pathlib.Path | dict[str, Any]) -> ModelConfig:
    """ModelConfig (Megatron field names) of an HF model directory or config.json dict."""
    source = "config.json"
    if not isinstance(hf, dict):
        source = str(pathlib.Path(hf) / "config.json")
        hf = read_hf_config(hf)
    fam = family_for_hf(hf, source)
    try:
        return fam.config_from_hf(hf, source)
    except (TypeError, KeyError) as exc:  # a key with the wrong type in the file
        raise ConversionError(f"{source}: unexpected value in config.json ({exc})") from exc


def hf_config_from_model(model_cfg: ModelConfig) -> dict[str, Any]:
    """Hub-style HF config.json dict for ``model_cfg`` (transformers 4/5 and SGLang read it)."""
    return get_family(model_cfg.family).config_to_hf(model_cfg)


# Fields that do not change the weights or the maths of a forward pass.
_NOT_ARCHITECTURE = {"params_dtype", "max_position_embeddings", "hf_dir", "init_method_std", "moe_aux_loss_coeff",
                     "moe_token_dispatcher_type", "moe_router_dtype"}


def architecture_diff(a: ModelConfig, b: ModelConfig) -> list[str]:
    """'field: a vs b' for every architecture field on which two model configs disagree.

    ``kv_channels`` None means hidden_size / num_attention_heads (Megatron's default): an explicit
    value equal to that is the same architecture (config.json always spells head_dim out).
    """
    a, b = _explicit_head_dim(a), _explicit_head_dim(b)
    return [f"{f.name}: {getattr(a, f.name)!r} vs {getattr(b, f.name)!r}" for f in dataclasses.fields(ModelConfig)
            if f.name not in _NOT_ARCHITECTURE and getattr(a, f.name) != getattr(b, f.name)]


def _explicit_head_dim(cfg: ModelConfig) -> ModelConfig:
    if cfg.kv_channels is not None:
        return cfg
    return dataclasses.replace(cfg, kv_channels=arch.head_dim(cfg))


def write_hf_template(model_cfg: ModelConfig, tokenizer: Any, out_dir: str | pathlib.Path) -> pathlib.Path:
    """config.json (+ tokenizer files) that make an exported weight dir a loadable HF model.

    ``tokenizer``: the task's tokenizer (``bos_id``/``eos_id``/``pad_id`` and ``save_hf_tokenizer``)
    or None for a model without one (the engines then take token ids only).
    """
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf = hf_config_from_model(model_cfg)
    if tokenizer is not None:
        hf.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
        tokenizer.save_hf_tokenizer(out_dir)
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2))
    return out_dir
