"""Advantages as the RL step attaches them (issue 16): plain token-level GAE reads the critic's own
values at observation tokens (the old code zeroed them, biasing a skip-vs-plain ablation whenever
γλ < 1), skip-observation GAE never reads them, and with γ = λ = 1 both coincide."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sao_megatron.config import AlgorithmConfig
from sao_megatron.config.schema import GaeConfig
from sao_megatron.scheduler.sample import Sample
from sao_megatron.training.step import rl_step
from sao_megatron.training.step.batch import prepare_batch

pytestmark = pytest.mark.unit


def multi_turn(n: int = 5) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        mask = [1, 1, 0, 0, 1, 1, 0, 1][: 5 + i % 4]  # observation runs between turns
        out.append(Sample(prompt_ids=[1, 2, 3], response_ids=list(range(4, 4 + len(mask))), action_mask=mask,
                          rollout_logprobs=[-1.0] * len(mask), versions=[0] * len(mask),
                          reward=float(torch.rand(1, generator=g)), index=i, group_id=i))
    return out


def reference_plain(rewards: list[float], values: list[float], mask: list[int], gamma: float, lam: float):
    """Every position up to the last action token is a step, with its own value (slow loop)."""
    last = max(i for i, m in enumerate(mask) if m)
    adv, nxt_v, nxt_a = [0.0] * len(mask), 0.0, 0.0
    for t in range(last, -1, -1):
        delta = rewards[t] + gamma * nxt_v - values[t]
        nxt_a = delta + gamma * lam * nxt_a
        nxt_v = values[t]
        adv[t] = nxt_a if mask[t] else 0.0
    return adv


def attach(gae: str, values_of, gamma=0.9, lam=0.8):
    batch = prepare_batch(multi_turn(), dp_rank=0, dp_size=1, pad_multiple=1, max_tokens=1 << 12, vocab_size=64,
                          device="cpu")
    values = [values_of(mb) for mb in batch.microbatches]
    alg = AlgorithmConfig(gae=GaeConfig(skip_observations=gae == "skip_observation", gamma=gamma, lam=lam))
    batch = rl_step.attach_advantages(batch, alg, values)
    return batch, values


def random_values(mb):
    return torch.randn(mb["tokens"].shape, generator=torch.Generator().manual_seed(int(mb["row"][0])))


def test_plain_gae_uses_the_critic_values_at_observation_tokens():
    batch, values = attach("token", random_values)
    for mb, v in zip(batch.microbatches, values):
        for b in range(mb["tokens"].shape[0]):
            mask = mb["action_mask"][b].long().tolist()
            expected = reference_plain(mb["token_rewards"][b].tolist(), v[b].tolist(), mask, 0.9, 0.8)
            assert mb["advantages"][b].tolist() == pytest.approx(expected, abs=1e-5)


def test_skip_observation_gae_never_reads_observation_values():
    batch_a, _ = attach("skip_observation", random_values)

    def scrambled(mb):  # same values at action tokens, garbage elsewhere
        v = random_values(mb)
        return torch.where(mb["action_mask"] > 0, v, torch.full_like(v, 1e3))

    batch_b, _ = attach("skip_observation", scrambled)
    for a, b in zip(batch_a.microbatches, batch_b.microbatches):
        assert torch.allclose(a["advantages"], b["advantages"], atol=1e-5)


def test_lambda_below_one_separates_the_two_estimators_and_one_joins_them():
    plain, _ = attach("token", random_values)
    skip, _ = attach("skip_observation", random_values)
    assert any(not torch.allclose(p["advantages"], s["advantages"], atol=1e-4)
               for p, s in zip(plain.microbatches, skip.microbatches))
    plain1, _ = attach("token", random_values, gamma=1.0, lam=1.0)  # telescopes to R - V either way
    skip1, _ = attach("skip_observation", random_values, gamma=1.0, lam=1.0)
    for p, s in zip(plain1.microbatches, skip1.microbatches):
        assert torch.allclose(p["advantages"], s["advantages"], atol=1e-6)


def reference_plain_returns(rewards: list[float], values: list[float], mask: list[int], gamma: float, lam: float):
    """Plain token GAE returns G_t = Â_t + V_t at every step from the first to the last action (slow loop)."""
    acts = [i for i, m in enumerate(mask) if m]
    ret, nxt_v, nxt_a = [0.0] * len(mask), 0.0, 0.0
    for t in range(acts[-1], -1, -1):
        nxt_a = rewards[t] + gamma * nxt_v - values[t] + gamma * lam * nxt_a
        nxt_v = values[t]
        ret[t] = nxt_a + values[t] if t >= acts[0] else 0.0
    return ret


def critic_loss(batch, monkeypatch, head_values):
    """The critic step's loss on every micro-batch with the head outputs given (no model: the loss
    function the optimizer step would run is captured and called)."""
    captured = {}

    def fake_step(ddp, optimizer, scheduler, mbs, loss_fn, *, ctx):
        captured["loss"] = sum(float(loss_fn(head_values(mb), mb)[0]) for mb in mbs)

    monkeypatch.setattr(rl_step, "optimizer_step", fake_step)
    critic = type("Critic", (), {"ddp": None, "optimizer": None, "scheduler": None})()
    rl_step.critic_update(critic, batch, ctx=None, value_clip=None)
    return captured["loss"]


def test_plain_gae_trains_the_critic_on_observation_steps(monkeypatch):
    """Issue 16: with plain token GAE the value loss covers the observation tokens between turns
    (standard token-level GAE), with their GAE returns as targets; skip-observation covers actions only."""
    batch, values = attach("token", random_values)
    for mb, v in zip(batch.microbatches, values):
        for b in range(mb["tokens"].shape[0]):
            mask = mb["action_mask"][b].long().tolist()
            expected = reference_plain_returns(mb["token_rewards"][b].tolist(), v[b].tolist(), mask, 0.9, 0.8)
            assert mb["returns"][b].tolist() == pytest.approx(expected, abs=1e-5)

    def head(mb):  # critic outputs: token_values shifts them right by one
        return torch.full((*mb["tokens"].shape, 1), 0.25)

    squares, count = 0.0, 0
    for s in multi_turn():  # the slow reference: ½ (V − G)² summed over the steps, over their number
        acts = [i for i, m in enumerate(s.action_mask) if m]
        for mb, v in zip(batch.microbatches, values):
            for b in range(mb["tokens"].shape[0]):
                if int(mb["row"][b]) != s.index:
                    continue
                p = len(s.prompt_ids)
                ret = reference_plain_returns(mb["token_rewards"][b].tolist(), v[b].tolist(),
                                              mb["action_mask"][b].long().tolist(), 0.9, 0.8)
                for t in range(p + acts[0], p + acts[-1] + 1):
                    squares += 0.5 * (0.25 - ret[t]) ** 2
                    count += 1
    assert count > sum(s.num_action_tokens for s in multi_turn())  # observation steps are in
    assert critic_loss(batch, monkeypatch, head) == pytest.approx(squares / count, rel=1e-5)


def test_skip_observation_value_loss_stays_on_action_tokens(monkeypatch):
    batch, values = attach("skip_observation", random_values)
    assert int(batch.value_mask.sum()) == batch.num_tokens
    for mb, v in zip(batch.microbatches, values):
        assert torch.equal(mb["value_mask"], mb["action_mask"])
        assert (mb["returns"][mb["action_mask"] == 0] == 0).all()
        assert torch.equal(mb["old_values"], v * mb["action_mask"])


def test_advantages_make_a_new_batch_and_leave_the_prepared_one_as_built():
    """Issue 38: a micro-batch's fields are declared once and never grown in place; what the step
    computes (advantages, returns, old values) is a new batch, so a batch holds the same whatever ran."""
    batch = prepare_batch(multi_turn(), dp_rank=0, dp_size=1, pad_multiple=1, max_tokens=1 << 12, vocab_size=64,
                          device="cpu")
    alg = AlgorithmConfig(gae=GaeConfig(skip_observations=True, gamma=0.9, lam=0.8))
    scored = rl_step.attach_advantages(batch, alg, [random_values(mb) for mb in batch.microbatches])
    for mb in batch.microbatches:
        assert "advantages" not in mb and "returns" not in mb and "value_mask" not in mb
    assert batch.value_mask is None and int(scored.value_mask.sum()) == batch.num_tokens
    for before, after in zip(batch.microbatches, scored.microbatches, strict=True):
        assert after.tokens is before.tokens  # the inputs are shared, not copied
        assert after.advantages.shape == after.returns.shape == before.tokens.shape
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.microbatches[0].advantages = scored.microbatches[0].advantages
