"""Top-k agreement of the DSA indexer: the engine's FP8 scoring against Megatron's, at 2k and 8k tokens.

    python dsa_topk_agreement.py RESULTS.json [--lengths 2048,8192] [--topk 2048] [--device cuda]

A tiny indexer (GLM-5's 32 heads of dim 128 and top-k of 2048, hidden size 256) on random hidden states: q = x Wq,
k = x Wk, per-head weights w = x Ww, as DSAIndexer computes them (no rope: it rotates q and k alike).
Megatron scores with ``dsa._compute_index_scores`` (fp32 einsum, ReLU, weighted head sum). SGLang's
indexer (DeepSeek-V3.2's ``fp8_index``) scores FP8 copies: q per (token, head) and k per token
quantised to float8_e4m3fn with amax/448 scales, the q scale folded into the weights, the k scale
applied after the head sum. Both take the causal top-k per query; agreement is
|top-k fp8 ∩ top-k megatron| / k over the queries that see more than k keys (the others select
every key on both sides). RESULTS.json: ``{"rows": [{"length", "agreement", "min_row", "queries"}]}``.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from megatron.core.transformer.experimental_attention_variant.dsa import _compute_index_scores

HEADS, DIM, HIDDEN = 32, 128, 256
"""GLM-5's indexer shape (index_n_heads 32, index_head_dim 128: one FP8 scale block per head) on a tiny hidden size."""
E4M3_MAX = 448.0


def quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) float8_e4m3fn copy and its fp32 scale, as SGLang's act_quant does it."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def fp8_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[b, sq, sk] index scores from FP8 q and k (dequantised products, fp32 accumulation)."""
    q8, qs = quant_fp8(q)  # [s, b, h, d], [s, b, h, 1]
    k8, ks = quant_fp8(k)  # [s, b, d], [s, b, 1]
    logits = torch.relu(torch.einsum("sbhd,tbd->sbht", q8.float(), k8.float()))
    scores = (logits * (w * qs.squeeze(-1)).unsqueeze(-1)).sum(dim=2)  # [sq, b, sk]
    return (scores * ks.squeeze(-1).transpose(0, 1).unsqueeze(0)).transpose(0, 1)


def causal_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    s = scores.shape[-1]
    future = torch.triu(torch.ones(s, s, dtype=torch.bool, device=scores.device), diagonal=1)
    return scores.masked_fill(future, float("-inf")).topk(topk, dim=-1).indices


def agreement(a: torch.Tensor, b: torch.Tensor, topk: int, length: int) -> tuple[float, float, int]:
    rows = torch.arange(topk, length, device=a.device)  # queries with more than topk causal keys
    hits = []
    for start in range(0, len(rows), 256):  # a chunk of query rows at a time: [rows, topk, topk] stays small
        r = rows[start: start + 256]
        hits.append((a[0, r].unsqueeze(-1) == b[0, r].unsqueeze(-2)).any(-1).sum(-1).float() / topk)
    frac = torch.cat(hits)
    return float(frac.mean()), float(frac.min()), len(rows)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("results")
    p.add_argument("--lengths", default="2048,8192")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    wq = torch.randn(HIDDEN, HEADS * DIM, generator=g) / HIDDEN ** 0.5
    wk = torch.randn(HIDDEN, DIM, generator=g) / HIDDEN ** 0.5
    ww = torch.randn(HIDDEN, HEADS, generator=g) / HIDDEN ** 0.5
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        x = torch.randn(length, 1, HIDDEN, generator=g).to(args.device, torch.bfloat16)
        q = (x @ wq.to(x)).view(length, 1, HEADS, DIM)
        k, w = x @ wk.to(x), (x @ ww.to(x)).float() * HEADS ** -0.5
        topk = min(args.topk, length // 2)  # at 2k a top-2048 keeps every key: compare a real choice
        ref = causal_topk(_compute_index_scores(q, w, k), topk)
        fp8 = causal_topk(fp8_scores(q, w, k), topk)
        mean, worst, n = agreement(ref, fp8, topk, length)
        rows.append({"length": length, "topk": topk, "agreement": mean, "min_row": worst, "queries": n})
        del ref, fp8
    with open(args.results, "w") as f:
        json.dump({"rows": rows, "device": args.device}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
