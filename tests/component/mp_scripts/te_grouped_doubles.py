"""TE grouped experts at EP>1 / expert-TP>1: load HF weights into module doubles and export them back.

    torchrun --nproc_per_node=4 te_grouped_doubles.py RESULTS.json WORKDIR

Transformer Engine needs CUDA, so these doubles reproduce the modules Megatron-core 0.19.2's
TEGroupedMLP builds (TEColumnParallelGroupedLinear for linear_fc1, TERowParallelGroupedLinear
for linear_fc2) with exactly the attributes that code and Transformer Engine 2.20.0.dev0
(github NVIDIA/TransformerEngine at d0067d0da6cb01811b8072a7d304f0e00344ce2b,
transformer_engine/pytorch/module/grouped_linear.py) set on them:

- Megatron's TEGroupedLinear.__init__: with EP>1 or expert-TP>1 (``explicit_expert_comm``) it
  divides out_features (column) or in_features (row) by the expert-TP size itself and hands TE
  ``parallel_mode=None, tp_size=1, tp_group=None``; it keeps the expert-TP group in ``_tp_group``.
- TE's GroupedLinear.__init__ / set_tensor_parallel_attributes: ``tp_group`` None (set through
  set_tensor_parallel_group(None) since tp_size == 1), ``weight{i}`` [out, in] per GEMM, each
  tagged ``tensor_model_parallel=True, partition_dim=0`` (``1 if parallel_mode == "row" else 0``
  with parallel_mode None), ``partition_stride=1``. With ``single_grouped_weight`` TE registers one
  ``weight`` GroupedTensor [num_gemms, out, in] (weight{i} set to None), tagged the same way; a
  GroupedTensor bans select/split/reshape-like ops and exposes per-GEMM views as
  ``quantized_tensors`` (plain tensors when unquantized).
- Megatron's _set_expert_parameter_attributes(module, original parallel_mode, use_expert_pgs),
  run after TE's init: ``allreduce = not use_expert_pgs``, ``tensor_model_parallel=True``,
  ``partition_dim = 1 if row else 0``, ``partition_stride=1``. The ``te_attrs_only`` scenario leaves
  this step out (TE's partition_dim=0 on fc2), as a Megatron without it would.

Each rank checks its shards against slices written out by hand from the HF tensors, then the
exporter's output against the HF tensors, for receivers "all" and "rank0".
"""

from __future__ import annotations

import json
import sys
import traceback

import torch
import torch.distributed as dist

from sao_megatron.config.schema import ModelConfig
from sao_megatron.models.families.base import ROUTED_EXPERTS, WeightMap
from sao_megatron.models.families.sharded import load_hf_weights
from sao_megatron.weights.export import ExportPlan, iter_hf_tensors

CFG = ModelConfig(num_layers=2, hidden_size=8, num_moe_experts=4, moe_ffn_hidden_size=6, moe_layer_freq=1,
                  params_dtype="fp32")
FC1, FC2 = ROUTED_EXPERTS[1], ROUTED_EXPERTS[2]  # the routed-expert fc1/fc2 rules of the family tables
# name: (EP, expert-TP, TE single grouped weight, Megatron's attribute fix-up applied)
SCENARIOS = {
    "ep2": (2, 1, False, True),
    "etp2": (1, 2, False, True),
    "ep2_etp2": (2, 2, False, True),
    "etp2_te_attrs_only": (1, 2, False, False),
    "single_weight_ep2_etp2": (2, 2, True, True),
    "single_weight_etp2": (1, 2, True, True),
}
_BANNED = {torch.Tensor.select, torch.Tensor.unbind, torch.Tensor.split, torch.Tensor.chunk, torch.Tensor.reshape,
           torch.Tensor.view, torch.Tensor.narrow, torch.Tensor.__getitem__, torch.Tensor.flatten,
           torch.Tensor.transpose, torch.Tensor.permute}


class GroupedTensorDouble(torch.Tensor):
    """TE's GroupedTensor as far as the exporter may touch it: no select/split/reshape-like ops."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _BANNED:
            raise RuntimeError(f"GroupedTensor bans {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs or {})


class GroupedLinearDouble(torch.nn.Module):
    """Megatron 0.19.2 TE{Column,Row}ParallelGroupedLinear over TE 2.20.0.dev0 GroupedLinear (see module doc)."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, parallel_mode: str, ep_size: int,
                 etp_group, single: bool, megatron_fixup: bool):
        super().__init__()
        etp = dist.get_world_size(etp_group)
        self._tp_group = etp_group                      # Megatron: pg_collection.expt_tp
        self.expert_parallel = ep_size > 1
        self.explicit_expert_comm = etp > 1 or self.expert_parallel
        te_mode, te_group = parallel_mode, etp_group
        if self.explicit_expert_comm:
            if parallel_mode == "column":
                output_size //= etp
            else:
                input_size //= etp
            te_mode, te_group = None, None
        self.num_gemms, self.parallel_mode, self.tp_size, self.tp_group = num_gemms, te_mode, 1, te_group
        self.in_features, self.out_features = input_size, output_size
        if single:
            data = torch.zeros(num_gemms, output_size, input_size)
            members = list(data.unbind(0))
            weight = torch.nn.Parameter(data.as_subclass(GroupedTensorDouble))
            weight.quantized_tensors = members
            self.register_parameter("weight", weight)
        else:
            for i in range(num_gemms):
                self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.zeros(output_size, input_size)))
        for _, param in self.named_parameters(recurse=False):  # TE: set_tensor_parallel_attributes
            param.tensor_model_parallel, param.partition_stride = True, 1
            param.partition_dim = 1 if te_mode == "row" else 0
        if megatron_fixup:  # Megatron: _set_expert_parameter_attributes(self, parallel_mode, use_expert_pgs)
            for _, param in self.named_parameters(recurse=False):
                param.allreduce = False
                param.tensor_model_parallel = True
                param.partition_dim = 1 if parallel_mode == "row" else 0

    def gemm_weight(self, i: int) -> torch.Tensor:
        """The i-th GEMM's weight as a plain tensor (test side, not through the exporter)."""
        if hasattr(self, "weight"):
            return self.weight.as_subclass(torch.Tensor)[i]
        return getattr(self, f"weight{i}")


def build_chunk(ep: int, etp: int, single: bool, fixup: bool) -> tuple[torch.nn.Module, dict]:
    """A model chunk whose layers hold only TEGroupedMLP doubles; also this rank's (ep_rank, etp_rank)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    etp_group = ep_group = None
    for dp in range(world // (ep * etp)):  # rank = (dp * ep + ep_rank) * etp + etp_rank; every rank makes every group
        for e in range(ep):
            g = dist.new_group([(dp * ep + e) * etp + t for t in range(etp)])
            etp_group = g if rank // etp == dp * ep + e else etp_group
        for t in range(etp):
            members = [(dp * ep + e) * etp + t for e in range(ep)]
            g = dist.new_group(members)
            ep_group = g if rank in members else ep_group
    num_local = CFG.num_moe_experts // ep
    layers = torch.nn.ModuleList()
    for number in range(1, CFG.num_layers + 1):
        experts = torch.nn.Module()
        experts.num_local_experts, experts.ep_group, experts.tp_group = num_local, ep_group, etp_group
        kw = dict(ep_size=ep, etp_group=etp_group, single=single, megatron_fixup=fixup)
        experts.linear_fc1 = GroupedLinearDouble(num_local, CFG.hidden_size, 2 * CFG.moe_ffn_hidden_size,
                                                 parallel_mode="column", **kw)
        experts.linear_fc2 = GroupedLinearDouble(num_local, CFG.moe_ffn_hidden_size, CFG.hidden_size,
                                                 parallel_mode="row", **kw)
        layer = torch.nn.Module()
        layer.layer_number, layer.mlp = number, torch.nn.Module()
        layer.mlp.experts = experts
        layers.append(layer)
    chunk = torch.nn.Module()
    chunk.decoder = torch.nn.Module()
    chunk.decoder.layers = layers
    return chunk, {"ep_rank": dist.get_rank(ep_group), "etp_rank": dist.get_rank(etp_group), "etp": etp,
                   "num_local": num_local}


class DictCheckpoint:
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def expected_shards(hf: dict[str, torch.Tensor], layer: int, expert: int, etp_rank: int, etp: int):
    """By hand: fc1 holds rows [r*F/n, (r+1)*F/n) of gate and of up, stacked; fc2 those columns of down."""
    f = CFG.moe_ffn_hidden_size // etp
    rows = slice(etp_rank * f, (etp_rank + 1) * f)
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    fc1 = torch.cat([hf[p + "gate_proj.weight"][rows], hf[p + "up_proj.weight"][rows]])
    return fc1, hf[p + "down_proj.weight"][:, rows]


def run_scenario(name: str, hf: dict[str, torch.Tensor]) -> dict:
    ep, etp, single, fixup = SCENARIOS[name]
    wmap = WeightMap(CFG, (FC1, FC2))
    chunk, where = build_chunk(ep, etp, single, fixup)
    load_hf_weights([chunk], wmap, DictCheckpoint(hf))
    ok = True
    for layer_idx, layer in enumerate(chunk.decoder.layers):
        experts = layer.mlp.experts
        for i in range(where["num_local"]):
            fc1, fc2 = expected_shards(hf, layer_idx, where["ep_rank"] * where["num_local"] + i, where["etp_rank"], etp)
            ok &= torch.equal(experts.linear_fc1.gemm_weight(i), fc1)
            ok &= torch.equal(experts.linear_fc2.gemm_weight(i), fc2)
    result = {"load_matches_reference": all_ranks(ok)}
    for receivers in ("all", "rank0"):
        got = dict(iter_hf_tensors(ExportPlan([chunk], wmap, bucket_bytes=600), receivers=receivers))
        receiving = receivers == "all" or dist.get_rank() == 0
        same = sorted(got) == sorted(hf) and all(torch.equal(got[k], hf[k]) for k in hf) if receiving else not got
        result[f"export_{receivers}_matches_hf"] = all_ranks(same)
    return result


def all_ranks(ok: bool) -> bool:
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    hf = {h: torch.randn(s) for h, s in WeightMap(CFG, (FC1, FC2)).hf_shapes().items()}
    report = {}
    for name in SCENARIOS:
        try:
            report[name] = run_scenario(name, hf)
        except Exception as exc:  # recorded per scenario; every rank fails the same way before any collective
            report[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
