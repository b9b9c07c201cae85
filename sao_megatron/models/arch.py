"""Model-shape rules every part of the system must agree on, written once (no torch, no Megatron).

The layout planner (``launch/planner.py``), the model builder and its layer specs, the HF
families (``models/families/``) and the critic all read these rules: which layers are MoE,
which DSA layers run their own indexer, how many vocabulary rows Megatron allocates, the
attention head dimension, and the parameter groups ``critic.trainable`` names. Each function takes any object with the
ModelConfig field names, so Megatron's ``TransformerConfig`` (same names) works too.
"""

from __future__ import annotations

import math
from typing import Any

VOCAB_DIVISIBLE_BY = 128
"""Megatron's ``make_vocab_size_divisible_by`` default: the padded vocab is a multiple of this times TP."""

PARAM_GROUPS = ("embedding", "attention", "norms", "router", "dense_mlp", "shared_experts", "routed_experts",
                "lm_head", "value_head")
"""Every parameter belongs to exactly one of these (``critic.trainable`` names them; ``all`` selects them all)."""


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Vocab rows Megatron allocates: the next multiple of ``divisible_by * tp``.

    Rows >= ``vocab_size`` are padding: log-probs mask them out (models.actor.token_logprobs)
    and the HF export drops them.
    """
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def head_dim(cfg: Any) -> int:
    """Per-head dimension of (non-MLA) attention: ``kv_channels``, or Megatron's default
    ``hidden_size / num_attention_heads`` when it is None."""
    return cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads


def is_moe_layer(cfg: Any, layer: int) -> bool:
    """Megatron's ``moe_layer_freq`` for 0-based ``layer``: an int N marks every N-th layer MoE,
    a list marks MoE layers with 1; no layer is MoE without ``num_moe_experts``."""
    if cfg.num_moe_experts is None:
        return False
    if isinstance(cfg.moe_layer_freq, list):
        return bool(cfg.moe_layer_freq[layer])
    return layer % cfg.moe_layer_freq == 0


def moe_layer_mask(cfg: Any) -> list[bool]:
    """``is_moe_layer`` for every layer, in order."""
    return [is_moe_layer(cfg, i) for i in range(cfg.num_layers)]


def runs_indexer(cfg: Any, layer: int) -> bool:
    """Whether 0-based ``layer`` computes its own DSA top-k ("full") or reuses an earlier one ("shared").

    HF (GLM-5 ``indexer_types``) and Megatron (``is_dsa_skip_topk_layer``) use the same schedule:
    layer i is full iff max(i + 1 - max(offset, 1), 0) is a multiple of ``dsa_indexer_topk_freq``.
    """
    freq = cfg.dsa_indexer_topk_freq or 1
    if freq <= 1:
        return True
    return max(layer + 1 - max(cfg.dsa_indexer_skip_topk_offset, 1), 0) % freq == 0
