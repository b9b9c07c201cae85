"""Weight-sync arithmetic vs a slow per-tensor enumeration of who sends what."""

from __future__ import annotations

import pytest

from sao_megatron.config.schema import ModelConfig, ParallelConfig, ResourcesConfig
from sao_megatron.launch.sync_estimate import estimate_sync

pytestmark = pytest.mark.unit


def reference_sender_params(m: ModelConfig, pp: int, ep: int) -> dict[tuple[int, int], int]:
    """Parameters per (stage, EP rank) owner, tensor by tensor, written out for a Qwen3-MoE-like model."""
    h, d = m.hidden_size, m.kv_channels or m.hidden_size // m.num_attention_heads
    owners: dict[tuple[int, int], int] = {}

    def add(stage, ep_rank, n):
        owners[(stage, ep_rank)] = owners.get((stage, ep_rank), 0) + n
    add(0, 0, m.vocab_size * h)  # embedding
    per_stage = m.num_layers // pp
    for layer in range(m.num_layers):
        s = layer // per_stage
        q, kv = m.num_attention_heads * d, m.num_query_groups * d
        for n in ((q + 2 * kv) * h, q * h, 2 * h):  # qkv, proj, two layer norms
            add(s, 0, n)
        if m.qk_layernorm:
            add(s, 0, 2 * d)
        add(s, 0, m.num_moe_experts * h)  # router
        for e in range(m.num_moe_experts):
            add(s, e // (m.num_moe_experts // ep), 3 * h * m.moe_ffn_hidden_size)
    add(pp - 1, 0, h)  # final norm
    if m.untie_embeddings_and_output_weights:
        add(pp - 1, 0, m.vocab_size * h)
    return owners


@pytest.mark.parametrize("pp, ep, untie", [(1, 1, True), (2, 4, True), (4, 2, False), (2, 8, True)])
def test_busiest_sender_and_engine_bytes(pp, ep, untie):
    m = ModelConfig(num_layers=8, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8, num_query_groups=4,
                    kv_channels=16, vocab_size=1000, num_moe_experts=8, moe_ffn_hidden_size=32, moe_router_topk=2,
                    untie_embeddings_and_output_weights=untie, qk_layernorm=True)
    r = ResourcesConfig(gpus_per_node=8, rollout_nodes=2, rollout_tp_size=4, link_gbps=80.0)
    e = estimate_sync(m, ParallelConfig(pipeline_model_parallel_size=pp, expert_model_parallel_size=ep), r)
    owners = reference_sender_params(m, pp, ep)
    total = sum(owners.values())
    assert e.total_bytes == 2 * total and e.engine_rank_bytes == 2 * total
    assert e.num_senders == len(owners) == pp * ep
    assert e.sender_bytes_max == 2 * max(owners.values())
    assert e.num_engines == 4  # 16 GPUs / TP4
    rate = 80e9 / 8
    assert e.sender_seconds == pytest.approx(2 * max(owners.values()) * 4 / rate)
    assert e.engine_seconds == pytest.approx(2 * total / rate)
    assert e.seconds == max(e.sender_seconds, e.engine_seconds)
    assert e.sharded_engine_rank_bytes == pytest.approx(2 * total / 4)
