"""DSA in bf16: forward + backward of a tiny GLM-5-shaped model (MLA + DeepSeek sparse attention)
against the same weights in fp32, on CUDA (gpu_check.sh) or the CPU (--cpu and the CPU test).

    python dsa_bf16.py OUT.json [--device cuda|cpu] [--seq-len 128] [--batch 2]

The model is configs/models/tiny_glm5.yaml (MLA with q/kv LoRA, DSA top-8 with a shared indexer
layer, a dense and an MoE layer with a shared expert), built twice through the project's builder
(fp32, then bf16 with the fp32 weights copied in), both run the actor's path: the project's causal
mask, ``token_logprobs`` of the tokens, loss = −mean log-prob, backward. The sequence (128) is
much longer than the top-k (8), so the sparse selection really drops keys. OUT.json:
``{"device", "seq_len", "loss_fp32", "loss_bf16", "logprob_max_diff", "logprob_mean_diff",
"grad_rel_err", "worst_grad_cos", "num_grads", "finite", "params"}``; the caller judges
(scripts/gpu_check_multi.py, ``DSA_BF16_TOL``).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

import torch

from sao_megatron.config import ParallelConfig, load_config
from sao_megatron.models.actor import token_logprobs
from sao_megatron.models.builder import build_model_chunks
from sao_megatron.parallel.bootstrap import destroy, init_distributed
from sao_megatron.training.step.forward import causal_mask

ROOT = pathlib.Path(__file__).resolve().parents[3]
MODEL = ROOT / "configs" / "models" / "tiny_glm5.yaml"


def build(dtype: str, ctx) -> torch.nn.Module:
    model = load_config(MODEL, [f"model.params_dtype={dtype}"]).model
    (chunk,) = build_model_chunks(model, ctx)
    return chunk.train()


def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """dst's parameters and floating buffers (expert bias) := src's, rounded to dst's dtype."""
    want = dict(src.named_parameters()) | dict(src.named_buffers())
    for name, t in [*dst.named_parameters(), *dst.named_buffers()]:
        if t.is_floating_point():
            t.data.copy_(want[name].data)


def run(chunk: torch.nn.Module, tokens: torch.Tensor, ctx, vocab_size: int):
    """(log-probs [b, s] fp32, loss, {name: grad fp32}) of one forward + backward."""
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    logits = chunk(tokens, positions, causal_mask(tokens.shape[1], tokens.device))
    lp, _ = token_logprobs(logits, tokens, tp_group=ctx.tp_group, vocab_size=vocab_size, with_entropy=False)
    loss = -lp[:, 1:].mean()
    loss.backward()
    grads = {n: p.grad.float() for n, p in chunk.named_parameters() if p.requires_grad and p.grad is not None}
    return lp.detach().float(), float(loss), grads


def compare(ref, got) -> dict:
    (lp32, loss32, g32), (lp16, loss16, g16) = ref, got
    assert g32.keys() == g16.keys(), sorted(g32.keys() ^ g16.keys())
    diff = (lp16 - lp32)[:, 1:].abs()
    err = math.sqrt(sum(float((g16[n] - g32[n]).pow(2).sum()) for n in g32))
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in g32.values()))
    cos = [float(torch.nn.functional.cosine_similarity(g16[n].flatten(), g32[n].flatten(), dim=0))
           for n in g32 if float(g32[n].norm()) > 0]
    finite = all(bool(torch.isfinite(g).all()) for g in g16.values()) and math.isfinite(loss16)
    return {"loss_fp32": loss32, "loss_bf16": loss16, "logprob_max_diff": float(diff.max()),
            "logprob_mean_diff": float(diff.mean()), "grad_rel_err": err / norm, "worst_grad_cos": min(cos),
            "num_grads": len(g16), "finite": finite}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    ctx = init_distributed(ParallelConfig(), seed=1, device=args.device, environ={})
    fp32, bf16 = build("fp32", ctx), build("bf16", ctx)
    copy_weights(fp32, bf16)
    vocab = load_config(MODEL).model.vocab_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (args.batch, args.seq_len), generator=g).to(ctx.device)
    result = compare(run(fp32, tokens, ctx, vocab), run(bf16, tokens, ctx, vocab))
    params = {str(p.device) for p in bf16.parameters()} | {str(p.dtype) for p in bf16.parameters()}
    result |= {"device": str(ctx.device), "seq_len": args.seq_len, "batch": args.batch, "params": sorted(params)}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    destroy()


if __name__ == "__main__":
    main()
