"""GPU only: the Transformer Engine model and the local-spec model agree through one checkpoint.

    python te_vs_local.py RESULTS.json WORKDIR

Saves the TE-spec actor, loads it into a local-spec actor (the layout CPU machines use), and
records the sharded checkpoint keys of both and the log-prob difference.
"""

from __future__ import annotations

import json
import sys

import torch

from sao_megatron.config.schema import ModelConfig, ParallelConfig
from sao_megatron.models.builder import build_model_chunks
from sao_megatron.training.run.checkpoint import load_checkpoint, save_checkpoint, sharded_model_state
from sao_megatron.parallel.bootstrap import destroy, init_distributed
from sao_megatron.training.step.forward import compute_logprobs

MODEL = ModelConfig(num_layers=3, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                    kv_channels=16, num_moe_experts=4, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1, 1],
                    moe_shared_expert_intermediate_size=32, vocab_size=100, max_position_embeddings=64)


def keys(chunks) -> list[str]:
    return sorted({v.key for v in sharded_model_state(chunks)["model"].values() if hasattr(v, "key")
                   and not v.key.endswith("_extra_state")})


def main(out_path: str, workdir: str) -> None:
    ctx = init_distributed(ParallelConfig(), seed=0)
    te = build_model_chunks(MODEL, ctx, use_te=True)
    local = build_model_chunks(MODEL, ctx, use_te=False)
    save_checkpoint(f"{workdir}/te", te)
    load_checkpoint(f"{workdir}/te", local)
    g = torch.Generator().manual_seed(0)
    mbs = [{"tokens": torch.randint(0, MODEL.vocab_size, (2, 16), generator=g).cuda()}]
    lp_te = compute_logprobs(te, mbs, ctx=ctx, vocab_size=MODEL.vocab_size)[0]
    lp_local = compute_logprobs(local, mbs, ctx=ctx, vocab_size=MODEL.vocab_size)[0]
    out = {"te_keys": keys(te), "local_keys": keys(local), "logprob_maxdiff": float((lp_te - lp_local).abs().max()),
           "te_modules": sorted({type(m).__name__ for m in te[0].modules() if "TE" in type(m).__name__})}
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
