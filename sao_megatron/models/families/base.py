"""Declarative HF <-> Megatron weight mapping shared by the model families.

A family is a table of :class:`Rule` s. Each rule names one *canonical*
Megatron tensor (global layer index ``{L}``, global expert id ``{E}``, TP1
layout, local-spec names) and the HF tensor(s) it is made of, the transform
between them and the HF shapes (symbolic, resolved from the ModelConfig).
:class:`WeightMap` instantiates the rules for one ModelConfig: the complete
ordered list of Megatron names, the HF names of each, and the tensor
transforms both ways. Nothing here touches torch.distributed or Megatron
modules; sharding is handled in ``hf_loader`` (import) and
``sao_megatron.weights.export`` (export).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from sao_megatron.config.schema import ModelConfig
from sao_megatron.models import arch
from sao_megatron.models.arch import is_moe_layer
from sao_megatron.models.arch import runs_indexer as dsa_runs_indexer


class ConversionError(ValueError):
    """Bad input to a conversion (unsupported model, missing/corrupt files, config/weights mismatch)."""


# Transforms between the HF tensors of a rule and its Megatron tensor.
COPY = "copy"
QKV = "qkv"            # q/k/v -> linear_qkv grouped per KV head: [q heads of group g; k_g; v_g] for g in groups
GATE_UP = "gate_up"    # gate_proj, up_proj -> linear_fc1 = [gate; up] along dim 0
VOCAB = "vocab"        # embedding / LM head: Megatron pads the vocab rows for TP

# Conditions a rule may require of a layer (``when``).
DENSE, MOE, SHARED, EXPERT_BIAS, QKV_BIAS, QK_NORM, UNTIED = (
    "dense", "moe", "shared_expert", "expert_bias", "qkv_bias", "qk_norm", "untied")
Q_LORA, Q_DIRECT, INDEXER = "q_lora", "q_direct", "indexer"  # MLA: compressed / direct queries; DSA layers


@dataclass(frozen=True, slots=True)
class Rule:
    """One Megatron tensor <- HF tensor(s)."""

    mcore: str
    """Canonical Megatron name template ({L}: global layer, {E}: global expert)."""
    hf: tuple[str, ...]
    """HF name templates, in the order the transform consumes them."""
    hf_shapes: tuple[tuple[str, ...], ...]
    """Symbolic HF shape of each HF tensor (symbols in ``shape_symbols``)."""
    transform: str = COPY
    """COPY, QKV, GATE_UP or VOCAB."""
    when: frozenset[str] = frozenset()
    """Conditions (DENSE, MOE, ...) all of which must hold for the rule to apply."""


def rule(mcore: str, hf: str | tuple[str, ...], shapes: tuple[str, ...] | tuple[tuple[str, ...], ...],
         transform: str = COPY, when: tuple[str, ...] = ()) -> Rule:
    """Compact constructor: a single HF name/shape may be given bare."""
    hf_t = (hf,) if isinstance(hf, str) else hf
    shapes_t = (shapes,) * len(hf_t) if shapes and isinstance(shapes[0], str) else shapes
    return Rule(mcore, hf_t, shapes_t, transform, frozenset(when))


def shape_symbols(cfg: ModelConfig) -> dict[str, int]:
    """Values of the symbols used in ``Rule.hf_shapes``."""
    head_dim = arch.head_dim(cfg)
    return {
        "V": cfg.vocab_size, "H": cfg.hidden_size, "D": head_dim,
        "Q": cfg.num_attention_heads * head_dim, "KV": cfg.num_query_groups * head_dim,
        "F": cfg.ffn_hidden_size, "FM": cfg.moe_ffn_hidden_size or 0,
        "FS": cfg.moe_shared_expert_intermediate_size or 0, "E": cfg.num_moe_experts or 0,
        **mla_shape_symbols(cfg),
    }


def mla_shape_symbols(cfg: ModelConfig) -> dict[str, int]:
    """Symbols of multi-head latent attention and the DSA indexer (0 when unused)."""
    if not cfg.multi_latent_attention:
        return {}
    nh, rope = cfg.num_attention_heads, cfg.qk_pos_emb_head_dim
    return {
        "QL": cfg.q_lora_rank or 0, "KVL": cfg.kv_lora_rank, "KVA": cfg.kv_lora_rank + rope,
        "QH": nh * (cfg.qk_head_dim + rope), "KVB": nh * (cfg.qk_head_dim + cfg.v_head_dim),
        "O": nh * cfg.v_head_dim, "ID": cfg.dsa_indexer_head_dim or 0,
        "IN": cfg.dsa_indexer_n_heads or 0, "IQ": (cfg.dsa_indexer_n_heads or 0) * (cfg.dsa_indexer_head_dim or 0),
    }


def layer_conditions(cfg: ModelConfig, layer: int | None) -> frozenset[str]:
    """The conditions that hold for ``layer`` (None: model-level tensors)."""
    conds = set()
    if cfg.untie_embeddings_and_output_weights:
        conds.add(UNTIED)
    if layer is not None:
        moe = is_moe_layer(cfg, layer)
        conds.add(MOE if moe else DENSE)
        if moe and cfg.moe_shared_expert_intermediate_size:
            conds.add(SHARED)
        if moe and cfg.moe_router_enable_expert_bias:
            conds.add(EXPERT_BIAS)
    if cfg.add_qkv_bias:
        conds.add(QKV_BIAS)
    if cfg.qk_layernorm:
        conds.add(QK_NORM)
    if cfg.multi_latent_attention:
        conds.add(Q_LORA if cfg.q_lora_rank else Q_DIRECT)
        if layer is not None and cfg.experimental_attention_variant == "dsa" and dsa_runs_indexer(cfg, layer):
            conds.add(INDEXER)
    return frozenset(conds)


@dataclass(frozen=True, slots=True)
class Entry:
    """One instantiated rule: a concrete Megatron tensor and its HF tensors."""

    mcore: str
    hf: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    transform: str
    rule: Rule


@dataclass(slots=True)
class WeightMap:
    """The rules of a family instantiated for one ModelConfig (every layer, every expert)."""

    cfg: ModelConfig
    rules: tuple[Rule, ...]
    fp32_hf_names: tuple[str, ...] = ()
    """Regexes of HF tensors stored in fp32 whatever the checkpoint dtype."""
    entries: list[Entry] = field(init=False)
    by_mcore: dict[str, Entry] = field(init=False)

    def __post_init__(self) -> None:
        self.entries = list(self._instantiate())
        self.by_mcore = {e.mcore: e for e in self.entries}

    def _instantiate(self) -> Iterator[Entry]:
        """Embedding, then layer by layer (experts in id order), then final norm and LM head."""
        sym = shape_symbols(self.cfg)
        first = [r for r in self.rules if r.mcore.startswith("embedding.")]
        layer_rules = [r for r in self.rules if "{L}" in r.mcore]
        last = [r for r in self.rules if r not in first and r not in layer_rules]
        steps = [(None, first), *((layer, layer_rules) for layer in range(self.cfg.num_layers)), (None, last)]
        for layer, rules in steps:
            conds = layer_conditions(self.cfg, layer)
            for r in rules:
                if not r.when <= conds:
                    continue
                for e in (range(sym["E"]) if "{E}" in r.mcore else [None]):
                    fmt = {"L": layer, "E": e}
                    yield Entry(r.mcore.format(**fmt), tuple(h.format(**fmt) for h in r.hf),
                                tuple(tuple(_eval_dim(d, sym) for d in s) for s in r.hf_shapes),
                                r.transform, r)

    def hf_names(self) -> list[str]:
        """Every HF tensor name the model has, in mapping order."""
        return [h for e in self.entries for h in e.hf]

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        return {h: s for e in self.entries for h, s in zip(e.hf, e.hf_shapes)}

    def entry(self, mcore_name: str) -> Entry:
        try:
            return self.by_mcore[mcore_name]
        except KeyError:
            raise ConversionError(
                f"Megatron tensor '{mcore_name}' has no HF mapping for model family '{self.cfg.family}': "
                "the model was built with a feature the family mapping does not cover") from None

    def is_fp32(self, hf_name: str) -> bool:
        """HF tensors kept in fp32 on disk (e.g. GLM's e_score_correction_bias)."""
        return any(re.fullmatch(p, hf_name) for p in self.fp32_hf_names)

    def to_mcore(self, mcore_name: str, hf_tensors: list[torch.Tensor], rows: int | None = None) -> torch.Tensor:
        """Full (unsharded) Megatron tensor from its HF tensors; ``rows`` pads a VOCAB tensor."""
        e = self.entry(mcore_name)
        return _TO_MCORE[e.transform](self.cfg, hf_tensors, rows)

    def to_hf(self, mcore_name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """HF (name, tensor) pairs from a full Megatron tensor (views where possible)."""
        e = self.entry(mcore_name)
        return list(zip(e.hf, _TO_HF[e.transform](self.cfg, tensor)))


def _eval_dim(sym: str, table: dict[str, int]) -> int:
    return int(table[sym]) if sym in table else int(sym)


def _groups(cfg: ModelConfig) -> tuple[int, int, int]:
    return cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups, arch.head_dim(cfg)


def qkv_to_mcore(cfg: ModelConfig, qkv: list[torch.Tensor], rows: int | None = None) -> torch.Tensor:
    """q [nh*d, ...], k/v [ng*d, ...] -> [ng*(nh/ng + 2)*d, ...] grouped per KV head."""
    ng, per_group, d = _groups(cfg)
    q, k, v = qkv
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(ng, per_group * d, *rest), k.reshape(ng, d, *rest),
                         v.reshape(ng, d, *rest)], dim=1)
    return grouped.reshape(ng * (per_group + 2) * d, *rest)


def qkv_to_hf(cfg: ModelConfig, t: torch.Tensor) -> list[torch.Tensor]:
    ng, per_group, d = _groups(cfg)
    rest = t.shape[1:]
    q, k, v = t.reshape(ng, (per_group + 2) * d, *rest).split([per_group * d, d, d], dim=1)
    return [q.reshape(ng * per_group * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest)]


def vocab_to_mcore(cfg: ModelConfig, ts: list[torch.Tensor], rows: int | None = None) -> torch.Tensor:
    (t,) = ts
    if rows is None or rows == t.shape[0]:
        return t
    if rows < t.shape[0]:
        raise ConversionError(f"Megatron vocab rows {rows} < HF vocab {t.shape[0]}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])  # padding rows are never looked up


_TO_MCORE: dict[str, Callable[[ModelConfig, list[torch.Tensor], int | None], torch.Tensor]] = {
    COPY: lambda cfg, ts, rows: ts[0],
    QKV: qkv_to_mcore,
    GATE_UP: lambda cfg, ts, rows: torch.cat(ts, dim=0),
    VOCAB: vocab_to_mcore,
}
_TO_HF: dict[str, Callable[[ModelConfig, torch.Tensor], list[torch.Tensor]]] = {
    COPY: lambda cfg, t: [t],
    QKV: qkv_to_hf,
    GATE_UP: lambda cfg, t: list(t.chunk(2, dim=0)),
    VOCAB: lambda cfg, t: [t[: cfg.vocab_size]],
}


# Building blocks for the family tables: HF names are the same in Qwen3-MoE and GLM-4.5.
_ML, _HL = "decoder.layers.{L}.", "model.layers.{L}."
EMBEDDING = rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", ("V", "H"), VOCAB)
FINAL_NORM = rule("decoder.final_layernorm.weight", "model.norm.weight", ("H",))
LM_HEAD = rule("output_layer.weight", "lm_head.weight", ("V", "H"), VOCAB, when=(UNTIED,))
ATTENTION = (
    rule(_ML + "input_layernorm.weight", _HL + "input_layernorm.weight", ("H",)),
    rule(_ML + "self_attention.linear_qkv.weight",
         tuple(_HL + f"self_attn.{p}_proj.weight" for p in "qkv"), (("Q", "H"), ("KV", "H"), ("KV", "H")), QKV),
    rule(_ML + "self_attention.linear_proj.weight", _HL + "self_attn.o_proj.weight", ("H", "Q")),
    rule(_ML + "pre_mlp_layernorm.weight", _HL + "post_attention_layernorm.weight", ("H",)),
)
QKV_BIASES = rule(_ML + "self_attention.linear_qkv.bias", tuple(_HL + f"self_attn.{p}_proj.bias" for p in "qkv"),
                  (("Q",), ("KV",), ("KV",)), QKV, when=(QKV_BIAS,))
QK_NORMS = (
    rule(_ML + "self_attention.q_layernorm.weight", _HL + "self_attn.q_norm.weight", ("D",), when=(QK_NORM,)),
    rule(_ML + "self_attention.k_layernorm.weight", _HL + "self_attn.k_norm.weight", ("D",), when=(QK_NORM,)),
)
DENSE_MLP = (
    rule(_ML + "mlp.linear_fc1.weight", (_HL + "mlp.gate_proj.weight", _HL + "mlp.up_proj.weight"),
         ("F", "H"), GATE_UP, when=(DENSE,)),
    rule(_ML + "mlp.linear_fc2.weight", _HL + "mlp.down_proj.weight", ("H", "F"), when=(DENSE,)),
)
_EXP = _HL + "mlp.experts.{E}."
ROUTED_EXPERTS = (
    rule(_ML + "mlp.router.weight", _HL + "mlp.gate.weight", ("E", "H"), when=(MOE,)),
    rule(_ML + "mlp.experts.local_experts.{E}.linear_fc1.weight",
         (_EXP + "gate_proj.weight", _EXP + "up_proj.weight"), ("FM", "H"), GATE_UP, when=(MOE,)),
    rule(_ML + "mlp.experts.local_experts.{E}.linear_fc2.weight", _EXP + "down_proj.weight", ("H", "FM"),
         when=(MOE,)),
)
ROUTER_EXPERT_BIAS = rule(_ML + "mlp.router.expert_bias", _HL + "mlp.gate.e_score_correction_bias", ("E",),
                          when=(MOE, EXPERT_BIAS))
_SH = _HL + "mlp.shared_experts."
SHARED_EXPERT = (
    rule(_ML + "mlp.shared_experts.linear_fc1.weight", (_SH + "gate_proj.weight", _SH + "up_proj.weight"),
         ("FS", "H"), GATE_UP, when=(MOE, SHARED)),
    rule(_ML + "mlp.shared_experts.linear_fc2.weight", _SH + "down_proj.weight", ("H", "FS"), when=(MOE, SHARED)),
)


@dataclass(frozen=True, slots=True)
class Family:
    """A supported model family: HF config translation + the weight mapping table."""

    name: str
    """ModelConfig.family value."""
    architectures: tuple[str, ...]
    """HF ``architectures`` entries handled."""
    model_types: tuple[str, ...]
    """HF ``model_type`` values handled."""
    rules: tuple[Rule, ...]
    """The declarative weight mapping."""
    config_from_hf: Callable[[dict[str, Any], str], ModelConfig]
    """(hf config.json dict, source for messages) -> ModelConfig."""
    config_to_hf: Callable[[ModelConfig], dict[str, Any]]
    """ModelConfig -> hub-style config.json dict."""
    fp32_hf_names: tuple[str, ...] = ()
    """Regexes of HF tensors that stay fp32 whatever the checkpoint dtype."""
    is_ignored_hf: Callable[[str, ModelConfig], bool] = lambda name, cfg: False
    """HF tensors present in checkpoints but not part of the Megatron model (e.g. GLM's MTP layers)."""

    def weight_map(self, cfg: ModelConfig) -> WeightMap:
        return WeightMap(cfg, self.rules, self.fp32_hf_names)

    def with_rules(self, rules: tuple[Rule, ...]) -> "Family":
        """A copy with another rule table (used by tests to prove the parity gate has teeth)."""
        return dataclasses.replace(self, rules=rules)
