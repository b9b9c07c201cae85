"""Tensors that SGLang's weight loader must see in ONE ``load_weights`` call, per model family (sglang 0.5.23).

A distributed weight update reaches SGLang as one ``model.load_weights(bucket)`` call per bucket
(``srt/model_executor/model_runner_components/weight_updater.py``). Most tensors load on their
own, but a few loaders keep state that lives for one call only; a pair split across two calls is
silently dropped (no error, the engine keeps its old weights for that parameter). The table:

| family (SGLang class) | group | members (under ``model.layers.N.``) | SGLang code that pairs them |
|---|---|---|---|
| qwen3_moe (``Qwen3MoeForCausalLM``) | none | - | ``models/qwen3_moe.py`` ``load_weights``: ``stacked_params_mapping`` shards (q/k/v -> qkv_proj, gate/up -> gate_up_proj) and experts each load into their own slice; nothing is kept between tensors |
| glm4_moe (``Glm4MoeForCausalLM``) | none | - | ``models/glm4_moe.py`` ``load_weights``: as Qwen3-MoE |
| deepseek_v3, deepseek_v32, glm_moe_dsa (``DeepseekV2WeightLoaderMixin.do_load_weights``) | ``a_proj`` | ``self_attn.q_a_proj.weight``, ``self_attn.kv_a_proj_with_mqa.weight`` and their ``weight_scale_inv`` | ``models/deepseek_common/deepseek_weight_loader.py``: ``cached_a_proj = {}`` is created per call; ``q_a_proj`` and ``kv_a_proj_with_mqa`` of one suffix are concatenated into ``fused_qkv_a_proj_with_mqa`` only when both are cached (a weight pairs with the other weight, a scale with the other scale; the four travel together so the fused weight and its scale change in the same call) |
| same | ``kv_b_proj`` | ``self_attn.kv_b_proj.weight`` + ``weight_scale_inv`` | same file, ``post_load_weights``: after each call it re-derives ``w_kc``/``w_vc`` of every layer whose ``kv_b_proj`` tensor was in the call, from the weight AND its scale; apart, one call derives them from a new weight and an old scale |
| deepseek_v32, glm_moe_dsa (DSA indexer) | ``indexer_wk`` | ``self_attn.indexer.wk.weight`` + ``weight_scale_inv`` | same file, ``_load_fused_indexer_wk``: with the fused bf16 ``wk_weights_proj`` (CUDA, interleaved indexer rope) a block-FP8 ``wk`` waits in ``pending_indexer_wk`` (created per call) for its scale, then is dequantized into the fused rows |
| same | ``indexer_weights_proj`` | ``self_attn.indexer.weights_proj.weight`` + ``weight_scale_inv`` | same, for ``weights_proj`` when it is sent as FP8 (SGLang builds it in bf16 otherwise) |

Plain FP8 linears and experts load their ``weight_scale_inv`` into its own parameter, so elsewhere a
weight and its scale may travel apart. ``tests/unit/test_loader_groups.py`` reads these mappings from
the pinned wheel and runs SGLang's own DeepSeek loader on the buckets.

:func:`plan_buckets` / :func:`iter_buckets` cut buckets as before (one dtype per bucket, at most
``max_bucket_bytes``, a larger unit alone) except that a group is one unit: never split, and held
back until all its members arrived. A group of mixed dtypes (FP8 weight + fp32 scale) joins the
bucket of its largest member's dtype; every bucket is ordered by decreasing element size, so each
tensor starts at a multiple of its own size in a flattened bucket (SGLang's
``FlattenedTensorBucket.empty`` refuses a misaligned tensor).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")
SCALE = "_scale_inv"


@dataclass(frozen=True, slots=True)
class LoaderGroup:
    """Tensors of one layer that one ``load_weights`` call must receive together."""

    name: str
    weights: tuple[str, ...]
    """Member weights, relative to the layer prefix (``model.layers.N.``); each may bring ``weight_scale_inv``."""
    always_together: bool
    """True: the weights pair with each other (fused); False: each weight pairs only with its own scale."""


A_PROJ = LoaderGroup("a_proj", ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"), True)
KV_B_PROJ = LoaderGroup("kv_b_proj", ("self_attn.kv_b_proj.weight",), False)
INDEXER_WK = LoaderGroup("indexer_wk", ("self_attn.indexer.wk.weight",), False)
INDEXER_WEIGHTS_PROJ = LoaderGroup("indexer_weights_proj", ("self_attn.indexer.weights_proj.weight",), False)

_MLA = (A_PROJ, KV_B_PROJ)
FAMILY_GROUPS: dict[str, tuple[LoaderGroup, ...]] = {
    "qwen3_moe": (),
    "glm4_moe": (),
    "deepseek_v3": _MLA,
    "deepseek_v32": (*_MLA, INDEXER_WK, INDEXER_WEIGHTS_PROJ),
    "glm_moe_dsa": (*_MLA, INDEXER_WK, INDEXER_WEIGHTS_PROJ),
}
"""The table of the module docstring, by ``model.family``."""
ANY_FAMILY = tuple(dict.fromkeys(g for groups in FAMILY_GROUPS.values() for g in groups))
"""Every family's groups: their names occur only in the families that list them, so this is exact for each."""


def groups_for(family: str | None) -> tuple[LoaderGroup, ...]:
    """The groups of ``family`` (None: :data:`ANY_FAMILY`); ValueError for a family without a table."""
    if family is None:
        return ANY_FAMILY
    if family not in FAMILY_GROUPS:
        raise ValueError(f"no loader-group table for model family {family!r}; add its SGLang loader's groups to "
                         f"FAMILY_GROUPS in sao_megatron/rollout/loader_groups.py (known: {sorted(FAMILY_GROUPS)})")
    return FAMILY_GROUPS[family]


def group_key(name: str, groups: Sequence[LoaderGroup]) -> Hashable | None:
    """The group an HF tensor belongs to (equal keys: one call), or None when it loads alone."""
    found = _match(name, groups, _suffixes(tuple(groups)))
    return None if found is None else found[0]


def _match(name: str, groups: Sequence[LoaderGroup], suffixes: tuple[str, ...],
           ) -> tuple[Hashable, str, bool, set[str]] | None:
    """(group key, the member weight ``name`` is or scales, whether it is a scale, the group's weights).

    A group that is not ``always_together`` is one group per weight (the weight and its scale).
    """
    if not name.endswith(suffixes):  # most tensors: one C-level check
        return None
    weight, is_scale = (name.removesuffix(SCALE), True) if name.endswith(SCALE) else (name, False)
    for group in groups:
        for member in group.weights:
            if weight.endswith("." + member):
                prefix = weight[: -len(member)]
                if group.always_together:
                    return (group.name, prefix), weight, is_scale, {prefix + m for m in group.weights}
                return (group.name, weight), weight, is_scale, {weight}
    return None


def _suffixes(groups: tuple[LoaderGroup, ...]) -> tuple[str, ...]:
    """Every name a member of ``groups`` ends with."""
    return tuple(f".{m}{s}" for g in groups for m in g.weights for s in ("", SCALE))


class _OpenGroup:
    """The members of one group that arrived so far; complete once every expected tensor is in."""

    def __init__(self, weights: set[str]):
        self.expected = set(weights)
        self.arrived: set[str] = set()
        self.items: list[tuple[int, torch.dtype, object]] = []

    def add(self, name: str, weight: str, is_scale: bool, unit: tuple[int, torch.dtype, object]) -> bool:
        """Add one member; True once the group is complete."""
        self.arrived.add(name)
        dtype = unit[1]
        if not is_scale and dtype.is_floating_point and dtype.itemsize == 1:
            self.expected.add(weight + SCALE)  # a block-FP8 weight travels with its scale
        self.items.append(unit)
        return self.expected <= self.arrived


class _Buckets:
    """The sync's size/dtype cutting: one pending bucket per dtype, closed when the next unit would overflow it."""

    def __init__(self, max_bucket_bytes: int):
        self.cap = max_bucket_bytes
        self.pending: dict[torch.dtype, tuple[list[tuple[int, torch.dtype, object]], int, bool]] = {}

    def add(self, unit: list[tuple[int, torch.dtype, object]]) -> list[object] | None:
        """Add a unit (one tensor or a whole group); returns the bucket it closed, if any."""
        if len(unit) == 1:
            (nbytes, dtype, _), mixed_unit = unit[0], False
        else:  # a group joins its largest member's bucket
            dtype, nbytes = max(unit, key=lambda u: u[0])[1], sum(u[0] for u in unit)
            mixed_unit = any(u[1] != dtype for u in unit)
        items, size, mixed = self.pending.get(dtype) or ([], 0, False)
        closed = None
        if items and size + nbytes > self.cap:
            closed, items, size, mixed = _aligned(items, mixed), [], 0, False
        items.extend(unit)
        self.pending[dtype] = (items, size + nbytes, mixed or mixed_unit)
        return closed

    def rest(self) -> Iterator[list[object]]:
        for items, _, mixed in self.pending.values():
            if items:
                yield _aligned(items, mixed)


def _aligned(items: list[tuple[int, torch.dtype, object]], mixed: bool) -> list[object]:
    """Payloads by decreasing element size (stable): each starts aligned in a flattened bucket."""
    if mixed:
        items = sorted(items, key=lambda u: -u[1].itemsize)
    return [payload for _, _, payload in items]


def iter_buckets(items: Iterable[tuple[str, int, torch.dtype, T]], *, family: str | None,
                 max_bucket_bytes: int) -> Iterator[list[T]]:
    """Buckets of payloads from a stream of (hf_name, nbytes, dtype, payload); see the module docstring.

    Streams: holds back only the members of groups that are still incomplete (flushed at the end
    if a member never comes, e.g. ``kv_a_proj_with_mqa`` of a model without ``q_lora_rank``).
    """
    groups = groups_for(family)
    suffixes = _suffixes(groups)
    buckets = _Buckets(max_bucket_bytes)
    open_groups: dict[Hashable, _OpenGroup] = {}
    for name, nbytes, dtype, payload in items:
        unit = (int(nbytes), dtype, payload)
        found = _match(name, groups, suffixes)
        if found is None:
            ready = [unit]
        else:
            key, weight, is_scale, weights = found
            if key not in open_groups:
                open_groups[key] = _OpenGroup(weights)
            if not open_groups[key].add(name, weight, is_scale, unit):
                continue
            ready = open_groups.pop(key).items
        closed = buckets.add(ready)
        if closed:
            yield closed
    for group in open_groups.values():
        closed = buckets.add(group.items)
        if closed:
            yield closed
    yield from buckets.rest()


def plan_buckets(names: Sequence[str], nbytes: Sequence[int], dtypes: Sequence[torch.dtype], *,
                 family: str | None, max_bucket_bytes: int) -> list[list[int]]:
    """Indices into ``names`` per bucket, in sending order (pure; :func:`iter_buckets` on the lists)."""
    if not len(names) == len(nbytes) == len(dtypes):
        raise ValueError(f"names, nbytes and dtypes differ in length: {len(names)}, {len(nbytes)}, {len(dtypes)}")
    return list(iter_buckets(zip(names, nbytes, dtypes, range(len(names))), family=family,
                             max_bucket_bytes=max_bucket_bytes))
