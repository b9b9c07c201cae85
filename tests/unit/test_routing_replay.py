"""Routing replay pieces without a model: route merging, pause mode, collation, config checks, and the
replay slot's token mapping against a slow per-token reference."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from sao_megatron.config import ConfigError, ExperimentConfig, from_dict, validate
from sao_megatron.scheduler.episode import EpisodeRunner
from sao_megatron.scheduler.routes import merge_routes
from sao_megatron.scheduler.sample import Sample, collate

pytestmark = pytest.mark.unit
MOE = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": 4,
       "num_moe_experts": 8, "moe_ffn_hidden_size": 32, "moe_router_topk": 2, "vocab_size": 128}


def test_first_reply_covering_a_position_fixes_its_route():
    first = np.arange(12).reshape(6, 2)          # rows 0..5 from the first request
    resubmit = 100 + np.arange(18).reshape(9, 2)  # its re-prefill recomputed rows 0..5, then rows 6..8
    merged = merge_routes(first, resubmit)
    np.testing.assert_array_equal(merged[:6], first)
    np.testing.assert_array_equal(merged[6:], resubmit[6:])
    assert merge_routes(merged, resubmit[:4]) is merged and merge_routes(None, first) is first
    assert merge_routes(first, None) is first and merge_routes(np.zeros((0, 2), int), first) is first
    with pytest.raises(ValueError, match="layouts"):
        merge_routes(first, np.zeros((9, 3), int))


@pytest.mark.parametrize("partial,routes,mode", [("retract", False, "retract"), ("retract", True, "abort"),
                                                  ("abort", False, "abort"), ("discard", True, "abort")])
def test_engines_are_paused_with_abort_when_routes_are_collected(partial, routes, mode):
    runner = EpisodeRunner(None, type("T", (), {"stop_token_ids": []})(), _sampling(), max_turns=1,
                           max_total_tokens=8, partial_rollout=partial, gate=asyncio.Event(), stats=None,
                           return_routed_experts=routes, env_threads=1)
    try:
        assert runner.pause_mode == mode
    finally:
        runner.close()


def _sampling():
    from sao_megatron.rollout.types import SamplingParams

    return SamplingParams(max_new_tokens=4)


def test_collate_places_route_rows_at_full_positions():
    a = Sample(prompt_ids=[5, 6], response_ids=[7, 8, 9], action_mask=[1, 1, 1], rollout_logprobs=[0.0] * 3,
               versions=[0] * 3, routed_experts=np.arange(16, dtype=np.int32).reshape(4, 2, 2))
    b = Sample(prompt_ids=[5], response_ids=[7], action_mask=[1], rollout_logprobs=[0.0], versions=[0])
    full = collate([a, b], pad_to_multiple=4)
    routes, valid = full["routed_experts"], full["route_valid"]
    assert routes.shape == (2, 8, 4) and valid.tolist() == [[True] * 4 + [False] * 4, [False] * 8]
    assert routes[0, 3].tolist() == [12, 13, 14, 15] and int(routes[1].abs().sum()) == 0
    assert "routed_experts" not in collate([b])


def test_config_routing_replay_checks():
    def make(**sections):
        tree = {"model": dict(MOE)}
        for name, values in sections.items():
            tree.setdefault(name, {}).update(values)
        return from_dict(ExperimentConfig, tree)

    validate(make(rollout={"routing_replay": True}))
    dense = {**{k: v for k, v in MOE.items() if not k.startswith(("num_moe", "moe_"))}, "num_moe_experts": None}
    with pytest.raises(ConfigError, match="routing_replay.*num_moe_experts"):
        validate(from_dict(ExperimentConfig, {"model": dense, "rollout": {"routing_replay": True}}))
    with pytest.raises(ConfigError, match="context_parallel_size=1 or rollout.routing_replay=false"):
        validate(make(rollout={"routing_replay": True}, parallel={"context_parallel_size": 2}))


@pytest.mark.parametrize("router", [{"router": "sglang_router"}, {"router_url": "http://127.0.0.1:30000"},
                                    {"router": "sglang_router", "router_url": "http://127.0.0.1:30000"}])
def test_config_refuses_routing_replay_through_sglang_router(router):
    """sglang-router drops return_routed_experts: refused, with the fix (engine_urls, builtin router)."""
    tree = {"model": dict(MOE), "rollout": {"engine": "sglang", "engine_urls": ["http://127.0.0.1:30001"], **router}}
    validate(from_dict(ExperimentConfig, tree))  # without routing replay the router is fine
    tree["rollout"]["routing_replay"] = True
    with pytest.raises(ConfigError, match="sglang-router.*return_routed_experts.*rollout.router=builtin.*engine_urls"):
        validate(from_dict(ExperimentConfig, tree))
    tree["rollout"] = {"engine": "sglang", "engine_urls": ["http://127.0.0.1:30001"], "routing_replay": True}
    validate(from_dict(ExperimentConfig, tree))  # the fix the message names passes


def test_replay_slot_maps_sequence_major_rows_and_sequence_parallel_slices():
    """Each router row (s * b + j, this TP rank's sequence slice) gets the route of token (j, s)."""
    from sao_megatron.models.routing_replay import LayerReplay, RouteReplay

    b, s, layers, k, experts = 2, 8, 3, 2, 6
    g = torch.Generator().manual_seed(0)
    routes = torch.argsort(torch.rand(b, s, layers, experts, generator=g), -1)[..., :k].reshape(b, s, -1).int()
    valid = torch.rand(b, s, generator=g) > 0.3
    for tp_rank in (0, 1):
        slot = LayerReplay(layer=1, topk=k)
        RouteReplay([slot], sequence_parallel=True, tp_rank=tp_rank, tp_size=2, recompute=False).prepare(
            {"routed_experts": routes, "route_valid": valid}, (b, s))
        scores = torch.rand(s // 2 * b, experts, generator=g)
        probs, idx = slot.get_replay_topk(scores, k, default_compute_topk=_topk)
        for row in range(s // 2 * b):
            pos, j = tp_rank * s // 2 + row // b, row % b  # slow reference: one token at a time
            want = routes[j, pos, k:2 * k].long() if valid[j, pos] else scores[row].topk(k).indices
            assert idx[row].tolist() == want.tolist()
            assert probs[row].tolist() == scores[row, want].tolist()
        mismatched, compared = slot.counts.tolist()
        own = scores.topk(k).indices.sort(-1).values
        want_mismatch = sum(bool(valid[r % b, tp_rank * s // 2 + r // b]) and idx[r].sort().values.tolist()
                            != own[r].tolist() for r in range(s // 2 * b))
        assert (mismatched, compared) == (want_mismatch, int(valid[:, tp_rank * s // 2:(tp_rank + 1) * s // 2].sum()))


def _topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def test_recomputed_router_in_backward_replays_its_own_microbatch_in_forward_order():
    """Full recomputation: forwards of micro-batches 1 (routes), 2 (none), 3 (routes), then their
    backwards re-run the router inside the autograd engine, in the same order."""
    from sao_megatron.models.routing_replay import LayerReplay, RouteReplay

    slot = LayerReplay(layer=0, topk=1)
    handle = RouteReplay([slot], sequence_parallel=False, tp_rank=0, tp_size=1, recompute=True)
    scores = torch.tensor([[0.9, 0.1, 0.0]])  # own choice: expert 0
    mbs = [{"routed_experts": torch.tensor([[[2]]]), "route_valid": torch.tensor([[True]])}, {},
           {"routed_experts": torch.tensor([[[1]]]), "route_valid": torch.tensor([[True]])}]
    forward = []
    for mb in mbs:
        with handle.replaying(mb, (1, 1)):
            forward.append(int(slot.get_replay_topk(scores, 1, default_compute_topk=_topk)[1]))
    assert int(slot.get_replay_topk(scores, 1, default_compute_topk=_topk)[1]) == 0  # released after each
    seen = []

    class Recompute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.extend(int(slot.get_replay_topk(scores, 1, default_compute_topk=_topk)[1]) for _ in mbs)
            return grad

    Recompute.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert forward == seen == [2, 0, 1] and not slot.recompute
