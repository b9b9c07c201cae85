"""The DSA indexer's KL loss (``model.dsa_indexer_loss_coeff``) on the tiny GLM-5, on CPU.

    python dsa_indexer_loss.py RESULTS.json COEFF

Builds actor and critic, runs one forward/backward of a loss on the actor's logits and records
which indexer parameters are trainable and received a non-zero gradient (megatron's own sparse
indexer loss reaches them through DSAIndexerLossAutoScaler; the top-k alone gives none).
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch

from sao_megatron.config import ParallelConfig, load_config
from sao_megatron.models.builder import build_model_chunks
from sao_megatron.parallel.bootstrap import destroy, init_distributed

ROOT = pathlib.Path(__file__).resolve().parents[3]


def main(out: str, coeff: str) -> None:
    ctx = init_distributed(ParallelConfig(), seed=1, environ={})
    model = load_config(ROOT / "configs/models/tiny_glm5.yaml", [f"model.dsa_indexer_loss_coeff={coeff}"]).model
    (actor,) = build_model_chunks(model, ctx)
    actor.train()
    tokens = torch.randint(0, model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(32).expand(2, 32)
    actor(input_ids=tokens, position_ids=positions, attention_mask=None).float().logsumexp(-1).mean().backward()
    indexer = {n: p for n, p in actor.named_parameters() if ".core_attention.indexer." in n}
    (critic,) = build_model_chunks(model, ctx, value_head=True)
    critic_indexer = [n for n, p in critic.named_parameters() if ".core_attention.indexer." in n and p.requires_grad]
    result = {"indexer": len(indexer), "trainable": sum(p.requires_grad for p in indexer.values()),
              "with_grad": sum(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in indexer.values()),
              "critic_trainable_indexer": len(critic_indexer)}
    pathlib.Path(out).write_text(json.dumps(result))
    destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
