"""Routing replay at several parallel layouts in one torchrun launch (4 ranks, gloo).

    torchrun --nproc_per_node=4 routing_replay_layouts.py RESULTS.json WORKDIR

A tiny GLM-flavoured MoE (a dense first layer, sigmoid router with expert bias) written once at the
reference layout and loaded at the others. Every layout computes the log-probs of the same two
micro-batches (different lengths, padded rows) with *forced* routes: random distinct expert ids per
(token, MoE layer), some rows without a route (they keep the router's own choice). Forced routes
move the log-probs far from the natural ones, so a token mapped to the wrong row (batch- instead of
sequence-major, the wrong sequence-parallel slice, another stage's layer) cannot match the
reference. Rank 0 records, per layout: max |log-prob − reference|, and the mismatch fraction.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.distributed as dist

from sao_megatron.config.schema import ModelConfig, ParallelConfig
from sao_megatron.models.builder import build_model_chunks
from sao_megatron.models.routing_replay import attach_route_replay, route_metrics
from sao_megatron.parallel.bootstrap import destroy, init_distributed
from sao_megatron.training.run.checkpoint import load_checkpoint, save_checkpoint
from sao_megatron.training.step.forward import compute_logprobs

MODEL = ModelConfig(
    family="glm4_moe", num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
    num_query_groups=2, kv_channels=8, num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
    moe_layer_freq=[0, 1, 1, 1], moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    moe_router_topk_scaling_factor=2.5, vocab_size=100, max_position_embeddings=64)
LAYOUTS = {
    "ref": ParallelConfig(),
    "tp2_ep2_sp": ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True),
    "pp2_ep2": ParallelConfig(pipeline_model_parallel_size=2, expert_model_parallel_size=2),
}


def microbatches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for seq in (16, 12):
        tokens = torch.randint(0, MODEL.vocab_size, (2, seq), generator=g)
        ids = torch.argsort(torch.rand(2, seq, MODEL.num_layers, MODEL.num_moe_experts, generator=g), -1)
        routes = ids[..., :MODEL.moe_router_topk].reshape(2, seq, -1).int()
        routes[:, :, :MODEL.moe_router_topk] = 0  # the dense layer's columns read 0, as SGLang sends them
        valid = torch.rand(2, seq, generator=g) > 0.2
        valid[1, seq - 3:] = False  # a shorter row: its padding has no route
        out.append({"tokens": tokens, "routed_experts": routes, "route_valid": valid})
    return out


def run_layout(name: str, workdir: str, mbs) -> dict:
    ctx = init_distributed(dataclasses.replace(LAYOUTS[name], use_distributed_optimizer=False), seed=5)
    actor = build_model_chunks(MODEL, ctx)
    if name == "ref":
        g = torch.Generator().manual_seed(0)  # distinct experts: routing must matter
        with torch.no_grad():
            for n, p in actor[0].named_parameters():
                if "norm" not in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        save_checkpoint(f"{workdir}/actor", actor)
    else:
        load_checkpoint(f"{workdir}/actor", actor)
    attach_route_replay(actor, ctx)
    natural = compute_logprobs(actor, [{"tokens": mb["tokens"]} for mb in mbs], ctx=ctx, vocab_size=MODEL.vocab_size)
    route_metrics(actor)  # only the replayed pass counts
    replayed = compute_logprobs(actor, mbs, ctx=ctx, vocab_size=MODEL.vocab_size)
    mismatch = route_metrics(actor)["rollout/route_mismatch_frac"]
    return {"natural": [t.tolist() for t in natural], "replayed": [t.tolist() for t in replayed],
            "mismatch": mismatch}


def main(out_path: str, workdir: str) -> None:
    mbs = microbatches()
    results = {}
    for name in LAYOUTS:
        results[name] = run_layout(name, workdir, mbs)
    rank = dist.get_rank()
    destroy()
    if rank == 0:
        ref = results["ref"]
        summary = {"ref_natural_vs_replayed": _maxdiff(ref["natural"], ref["replayed"])}
        for name, res in results.items():
            summary[name] = {"replayed_vs_ref": _maxdiff(res["replayed"], ref["replayed"]),
                             "natural_vs_ref": _maxdiff(res["natural"], ref["natural"]),
                             "mismatch": res["mismatch"]}
        json.dump(summary, open(out_path, "w"), indent=1)


def _maxdiff(a, b) -> float:
    return max(float((torch.tensor(x) - torch.tensor(y)).abs().max()) for x, y in zip(a, b))


if __name__ == "__main__":
    main(*sys.argv[1:3])
