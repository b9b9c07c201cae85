"""GLM-5 (transformers ``GlmMoeDsaForCausalLM``, model_type ``glm_moe_dsa``): MLA + DeepSeek sparse attention.

Attention and MoE are DeepSeek-V3's (``families/mla.py``); every layer's
attention is DSA: a lightweight indexer (``wq_b`` on the compressed query,
``wk`` + LayerNorm on the hidden state, per-head ``weights_proj``) scores all
earlier keys and each query attends only to its top ``index_topk``.
``indexer_types`` marks each layer "full" (runs its indexer) or "shared"
(reuses the previous full layer's top-k, and has no indexer weights); it maps
to Megatron's skip-top-k schedule (``dsa_indexer_topk_freq`` /
``dsa_indexer_skip_topk_offset``) when it has that periodic shape, and is
refused otherwise. The indexer rotates interleaved rope pairs
(``dsa_indexer_rope_interleaved``) and normalises keys with eps 1e-6.
Megatron's indexer also applies a Hadamard rotation to q and k, which leaves
their dot products and hence the selection unchanged (transformers skips it).
"""

from __future__ import annotations

from typing import Any

from sao_megatron.config.schema import ModelConfig
from sao_megatron.models.families import base as b
from sao_megatron.models.families import mla
from sao_megatron.models.families.hf_config import HfConfigView

RULES: tuple[b.Rule, ...] = (b.EMBEDDING, *mla.MLA_ATTENTION, *mla.DSA_INDEXER, *mla.MOE_BLOCK, b.FINAL_NORM,
                             b.LM_HEAD)
INDEXER_K_NORM_EPS = 1e-6
"""transformers' ``GlmMoeDsaIndexer.k_norm`` hard-codes this epsilon."""


def indexer_schedule(types: list[str], source: str) -> tuple[int, int]:
    """(dsa_indexer_topk_freq, dsa_indexer_skip_topk_offset) reproducing ``indexer_types`` exactly."""
    if set(types) - {"full", "shared"}:
        raise b.ConversionError(f"{source}: indexer_types may only hold 'full'/'shared', got {sorted(set(types))}")
    if "shared" not in types:
        return 1, 0
    for freq in range(2, len(types) + 1):
        for offset in range(1, len(types) + 1):
            probe = ModelConfig(num_layers=len(types), dsa_indexer_topk_freq=freq, dsa_indexer_skip_topk_offset=offset)
            if [("full" if b.dsa_runs_indexer(probe, i) else "shared") for i in range(len(types))] == types:
                return freq, offset
    raise b.ConversionError(f"{source}: indexer_types {types} is not a periodic skip-top-k schedule that Megatron "
                            "can express (dsa_indexer_topk_freq / dsa_indexer_skip_topk_offset)")


def config_from_hf(hf: dict[str, Any], source: str) -> ModelConfig:
    c = HfConfigView(hf, source)
    fields = mla.mla_model_fields(c)
    c.require(fields["q_lora_rank"] is not None, "q_lora_rank=null with DSA")
    num_layers = fields["num_layers"]
    types = c.get("indexer_types", default=None) or _types_from_freq(c, num_layers)
    if len(types) != num_layers:
        raise b.ConversionError(f"{source}: indexer_types has {len(types)} entries for {num_layers} layers")
    freq, offset = indexer_schedule(list(types), source)
    return ModelConfig(
        family="glm_moe_dsa", **fields, experimental_attention_variant="dsa",
        dsa_indexer_n_heads=c.get("index_n_heads"), dsa_indexer_head_dim=c.get("index_head_dim"),
        dsa_indexer_topk=c.get("index_topk"), dsa_indexer_topk_freq=freq, dsa_indexer_skip_topk_offset=offset,
        dsa_indexer_rope_interleaved=True, dsa_indexer_k_norm_epsilon=INDEXER_K_NORM_EPS,
    )


def _types_from_freq(c: HfConfigView, num_layers: int) -> list[str]:
    """transformers' default when a config spells the schedule as index_topk_freq / index_skip_topk_offset."""
    pattern = c.get("index_topk_pattern", default=None)
    if pattern is not None:
        return [{"F": "full", "S": "shared"}.get(ch, ch) for ch in pattern]
    freq, offset = max(c.get("index_topk_freq", default=1), 1), c.get("index_skip_topk_offset", default=2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    mla.check_mla_expressible(cfg, "glm_moe_dsa")
    if cfg.experimental_attention_variant != "dsa" or not cfg.dsa_indexer_rope_interleaved:
        raise b.ConversionError("glm_moe_dsa needs model.experimental_attention_variant='dsa' and "
                                "model.dsa_indexer_rope_interleaved=true")
    types = ["full" if b.dsa_runs_indexer(cfg, i) else "shared" for i in range(cfg.num_layers)]
    return {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", **mla.mla_hf_fields(cfg),
            "index_n_heads": cfg.dsa_indexer_n_heads, "index_head_dim": cfg.dsa_indexer_head_dim,
            "index_topk": cfg.dsa_indexer_topk, "indexer_types": types,
            # SGLang reads this key (absent: False) to pick the indexer's rope style; without it, it
            # rotates half-split (neox) keys that Megatron rotated in interleaved pairs.
            "indexer_rope_interleave": True,
            "mlp_layer_types": ["sparse" if b.is_moe_layer(cfg, i) else "dense" for i in range(cfg.num_layers)]}


FAMILY = b.Family(
    name="glm_moe_dsa", architectures=("GlmMoeDsaForCausalLM",), model_types=("glm_moe_dsa",), rules=RULES,
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, fp32_hf_names=mla.FP32_HF_NAMES,
    is_ignored_hf=mla.is_ignored_hf,
)
