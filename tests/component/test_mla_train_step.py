"""A tiny GLM-5-shaped actor and critic (MLA + DSA, shared-indexer layer) train on CPU.

Forward and backward through megatron-core's absorbed MLA + sparse attention on CPU (the
Hadamard shim in place), the indexer frozen at build (no gradient reaches it through the top-k),
every other parameter receiving a gradient, and the critic's value head output.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from sao_megatron.config import load_config

pytestmark = pytest.mark.component
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ctx(megatron_ctx):
    """Megatron in this process for this module only (see conftest.megatron_ctx)."""
    return megatron_ctx


def test_tiny_glm5_actor_backward_and_critic_values(ctx):
    from sao_megatron.models.builder import build_model_chunks

    model = load_config(ROOT / "configs/models/tiny_glm5.yaml").model
    (actor,) = build_model_chunks(model, ctx)
    tokens = torch.randint(0, model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(32).expand(2, 32)
    logits = actor(input_ids=tokens, position_ids=positions, attention_mask=None)
    logits.float().logsumexp(-1).mean().backward()
    params = dict(actor.named_parameters())
    indexer = [n for n in params if ".core_attention.indexer." in n]
    assert len(indexer) == 5  # layer 1 only: layer 2 reuses its top-k and has no indexer
    assert all(not params[n].requires_grad for n in indexer)
    assert [n for n, p in params.items() if p.requires_grad and p.grad is None] == []
    (critic,) = build_model_chunks(model, ctx, value_head=True)
    assert critic(input_ids=tokens, position_ids=positions, attention_mask=None).shape == (2, 32, 1)
