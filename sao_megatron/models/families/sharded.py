"""The local tensors of a sharded Megatron model, under canonical (TP1, global-index) names.

Works on any TP/EP/PP/VPP layout and on both the local and the Transformer
Engine spec: layer indices come from each layer's global ``layer_number``,
expert ids from the experts module's EP rank, the shard group from the
owning linear layer's ``tp_group`` (TP, or expert-TP inside experts). Also
loads HF tensors into such a model (each rank reads only what it holds).

TE grouped experts (Megatron's TEGroupedMLP over TE's GroupedLinear) need
their own reading. At EP>1 or expert-TP>1 Megatron hands TE
``parallel_mode=None, tp_group=None`` (it does the expert communication
itself), while the weights stay tagged ``tensor_model_parallel``: the shard
group is the wrapper's expert-TP group (``_tp_group``), and the shard dim is
the one Megatron's own checkpoint uses for the role (fc1 column-parallel: dim
0, fc2 row-parallel: dim 1), never TE's ``partition_dim`` (0 for both when
TE is told ``parallel_mode=None``). TE's single-parameter mode
(``single_grouped_weight``) holds all local experts in one ``weight``
[num_local_experts, out, in]; it is split into its per-expert views.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sao_megatron.models.families.base import GATE_UP, VOCAB, ConversionError, WeightMap

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_GROUPED_EXPERT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")  # TE grouped GEMM
_GROUPED_PARAM = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d*)$")  # weight{i}, or TE's single `weight`
# Shard dim of each grouped-expert GEMM's [out, in] weight under expert-TP, as Megatron's
# TEColumnParallelGroupedLinear / TERowParallelGroupedLinear checkpoint it (tp_axis_map).
_GROUPED_SHARD_DIM = {"linear_fc1": 0, "linear_fc2": 1}
# TE fuses norms into the following linear layer; canonical names use the local-spec modules.
_TE_ALIASES = {".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
               ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
               # MLA (TE spec, no DSA): the q/kv latent norms are fused into the up projections.
               ".self_attention.linear_q_up_proj.layer_norm_weight": ".self_attention.q_layernorm.weight",
               ".self_attention.linear_kv_up_proj.layer_norm_weight": ".self_attention.kv_layernorm.weight"}


@dataclass(slots=True)
class LocalTensor:
    """One parameter/buffer this rank holds (possibly a TP shard of the canonical tensor)."""

    name: str
    """Canonical Megatron name (global layer index and expert id, TP1 layout)."""
    tensor: torch.Tensor
    """The live parameter or buffer."""
    group: dist.ProcessGroup | None
    """Group the tensor is sharded over (TP or expert-TP); None when this rank holds it whole."""
    partition_dim: int
    """Sharded dimension (meaningful when ``group`` is set)."""
    gated: bool
    """SwiGLU linear_fc1: the shard is [gate_r; up_r], not a contiguous slice of [gate; up]."""

    @property
    def group_size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.tensor.shape)
        shape[self.partition_dim] *= self.group_size
        return tuple(shape)


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def local_tensors(model_chunks: list[torch.nn.Module], wmap: WeightMap) -> list[LocalTensor]:
    """Every mapped tensor of this rank's model chunks, in module order."""
    out: list[LocalTensor] = []
    for chunk in map(unwrap, model_chunks):
        named = list(chunk.named_parameters()) + [(n, b) for n, b in chunk.named_buffers()
                                                  if n.endswith("router.expert_bias")]
        for param_name, param in named:
            for local_name, tensor in _per_gemm(chunk, param_name, param):
                name = canonical_name(chunk, local_name)
                if name == "output_layer.weight" and not wmap.cfg.untie_embeddings_and_output_weights:
                    continue  # last-stage copy of the tied embedding
                entry = wmap.entry(name)
                out.append(_describe(chunk, local_name, name, tensor, entry.transform == GATE_UP))
    return out


def _per_gemm(chunk: torch.nn.Module, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``[(name, tensor)]``; TE's single grouped ``weight`` [G, out, in] -> ``[(...weight{i}, view_i)]``.

    The views share the parameter's storage, so loading into them fills the parameter.
    """
    m = _GROUPED_PARAM.search(name)
    if m is None or m.group(2):
        return [(name, tensor)]
    module = chunk.get_submodule(name.rsplit(".", 1)[0])
    members = getattr(tensor, "quantized_tensors", None)
    if members is None:  # TE's GroupedTensor bans select/split; its members are views of its storage
        members = tensor.split_into_quantized_tensors() if hasattr(tensor, "split_into_quantized_tensors") \
            else tensor.unbind(0)
    if len(members) != module.num_gemms or any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in members):
        raise ConversionError(f"'{name}': expected {module.num_gemms} unquantized expert weights in TE's single "
                              "grouped weight; FP8/FP4 primary weights cannot be converted, build the model "
                              "with high-precision parameters")
    return [(f"{name}{i}", t) for i, t in enumerate(members)]


def canonical_name(chunk: torch.nn.Module, local_name: str) -> str:
    name = local_name
    for te, local in _TE_ALIASES.items():
        if name.endswith(te):
            name = name[: -len(te)] + local
    m = _LAYER.match(name)
    if m:
        layer = chunk.decoder.layers[int(m.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}." + name[m.end():]
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            offset = dist.get_rank(experts.ep_group) * experts.num_local_experts if experts.ep_group else 0
            name = _LOCAL_EXPERT.sub(lambda e: f".mlp.experts.local_experts.{offset + int(e.group(1))}.", name)
            name = _GROUPED_EXPERT.sub(
                lambda e: f".mlp.experts.local_experts.{offset + int(e.group(2))}.{e.group(1)}.weight", name)
    return name


def _describe(chunk: torch.nn.Module, local_name: str, name: str, tensor: torch.Tensor, gated: bool) -> LocalTensor:
    grouped = _GROUPED_EXPERT.search(local_name)
    if grouped is None and not getattr(tensor, "tensor_model_parallel", False):
        return LocalTensor(name, tensor, None, 0, gated)
    module = chunk.get_submodule(local_name.rsplit(".", 1)[0])
    # Megatron's wrappers keep the group they shard over in `_tp_group` (the expert-TP group for
    # experts); TE's own `tp_group` is None whenever Megatron does the expert communication.
    group = getattr(module, "_tp_group", None)
    group = getattr(module, "tp_group", None) if group is None else group
    if group is None:
        raise ConversionError(f"cannot find the tensor-parallel group of '{local_name}' "
                              f"({type(module).__name__} has neither _tp_group nor tp_group)")
    dim = _GROUPED_SHARD_DIM[grouped.group(1)] if grouped else int(getattr(tensor, "partition_dim", 0))
    return LocalTensor(name, tensor, None if dist.get_world_size(group) == 1 else group, dim, gated)


def take_shard(full: torch.Tensor, lt: LocalTensor) -> torch.Tensor:
    """This rank's shard of the canonical tensor ``full``."""
    if lt.group is None:
        return full
    n, r, dim = lt.group_size, dist.get_rank(lt.group), lt.partition_dim
    if lt.gated:  # each rank holds [gate_r; up_r]
        return torch.cat([half.chunk(n, dim)[r] for half in full.chunk(2, dim)], dim)
    return full.chunk(n, dim)[r]


def gather_full(lt: LocalTensor) -> torch.Tensor:
    """The canonical tensor from the shards of ``lt.group`` (collective over that group)."""
    if lt.group is None:
        return lt.tensor.detach()
    local = lt.tensor.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(lt.group_size)]
    dist.all_gather(parts, local, group=lt.group)
    dim = lt.partition_dim
    if lt.gated:
        halves = [p.chunk(2, dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)
    return torch.cat(parts, dim)


def check_coverage(tensors: list[LocalTensor], wmap: WeightMap) -> None:
    """ConversionError unless the ranks together hold every tensor of the mapping (collective)."""
    names = [lt.name for lt in tensors]
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    held = {n for part in gathered for n in part or []}
    missing = [e.mcore for e in wmap.entries if e.mcore not in held]
    if missing:
        raise ConversionError(f"the Megatron model lacks {len(missing)} tensors of the {wmap.cfg.family} mapping "
                              f"(e.g. {missing[:3]}): the model builder does not build this feature")


@torch.no_grad()
def load_hf_weights(model_chunks: list[torch.nn.Module], wmap: WeightMap, ckpt, *, progress: bool = False) -> int:
    """Copy HF tensors (``ckpt``: HfCheckpoint) into this rank's shards; returns the count. Collective."""
    tensors = local_tensors(model_chunks, wmap)
    check_coverage(tensors, wmap)
    bar = _progress(len(tensors), "hf -> megatron", progress)
    for lt in tensors:
        entry = wmap.entry(lt.name)
        rows = lt.full_shape()[0] if entry.transform == VOCAB else None
        full = wmap.to_mcore(lt.name, [ckpt.get(h) for h in entry.hf], rows)
        shard = take_shard(full, lt)
        if tuple(shard.shape) != tuple(lt.tensor.shape):
            raise ConversionError(f"'{lt.name}': HF tensors give shape {list(shard.shape)} for this rank, "
                                  f"the Megatron model has {list(lt.tensor.shape)}")
        lt.tensor.copy_(shard)
        bar.update(1)
    bar.close()
    return len(tensors)


def load_hf_dir(model_chunks: list[torch.nn.Module], model_cfg, hf_dir, *, progress: bool = False) -> None:
    """Validate ``hf_dir`` against ``model_cfg`` and load its weights into the (sharded) model. Collective.

    For a trainer starting from an HF checkpoint (``model.hf_dir``) without a converted copy.
    """
    from sao_megatron.models.families import architecture_diff, get_family, model_config_from_hf
    from sao_megatron.models.families.hf_files import HfCheckpoint

    diffs = architecture_diff(model_cfg, model_config_from_hf(hf_dir))
    if diffs:
        raise ConversionError(f"{hf_dir}/config.json does not describe the configured model: {'; '.join(diffs[:3])}")
    family = get_family(model_cfg.family)
    wmap = family.weight_map(model_cfg)
    ckpt = HfCheckpoint(hf_dir)
    ckpt.validate(family, wmap)
    load_hf_weights(model_chunks, wmap, ckpt, progress=progress)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled)
