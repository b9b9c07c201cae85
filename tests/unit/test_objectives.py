"""The objectives table drives the RL step: each objective's policy loss is its loss function called with
its own config section's knobs and the ratio against its behaviour log-probs, and its advantages come from
its estimator. The references below are the library's loss/advantage functions called directly with
hand-written knobs (the functions themselves are checked against slow loops in test_losses/test_advantages)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from sao_megatron.algorithms import advantages as adv_lib
from sao_megatron.algorithms import losses as loss_lib
from sao_megatron.algorithms.objectives import OBJECTIVES
from sao_megatron.config import AlgorithmConfig, from_dict
from sao_megatron.scheduler.sample import Sample
from sao_megatron.training.step import rl_step
from sao_megatron.training.step.batch import prepare_batch
from sao_megatron.training.step.optim import UpdateResult

pytestmark = pytest.mark.unit
V = 16
KNOBS = {"gae": {"gamma": 0.9, "lam": 0.8, "skip_observations": False}, "group": {"normalize_std": False},
         "running_mean": {"momentum": 0.5}, "dis": {"eps_low": 0.5, "eps_high": 0.4},
         "ppo_clip": {"clip_low": 0.1, "clip_high": 0.15, "dual_clip": 1.5}}
# What each objective is (paper §4.1 and the baselines), written out by hand.
SPEC = {"sao": ("gae", "dis", "rollout_logprobs"), "ppo": ("gae", "ppo_clip", "rollout_logprobs"),
        "grpo": ("group", "ppo_clip", "old_logprobs"), "grpo_dis": ("group", "dis", "rollout_logprobs"),
        "sao_running_mean": ("running_mean", "dis", "rollout_logprobs")}
LOSS_FN = {"dis": loss_lib.dis_policy_loss, "ppo_clip": loss_lib.ppo_clip_policy_loss}


def samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        mask = [1, 1, 0, 0, 1, 1, 0, 1][: 5 + i % 4]
        n = len(mask)
        out.append(Sample(prompt_ids=[1, 2, 3], response_ids=torch.randint(4, V, (n,), generator=g).tolist(),
                          action_mask=mask, rollout_logprobs=(-3 * torch.rand(n, generator=g)).tolist(),
                          versions=[0] * n, reward=float(torch.rand(1, generator=g)), index=i, group_id=i // 2))
    return out


def config(name: str) -> AlgorithmConfig:
    est, loss, _ = SPEC[name]
    return from_dict(AlgorithmConfig, {"name": name, "group_size": 2, est: KNOBS[est], loss: KNOBS[loss]})


def logits_of(mb, i):
    return torch.randn(*mb["tokens"].shape, V, generator=torch.Generator().manual_seed(i))


def old_logprobs_of(mbs):
    return [torch.randn(mb["tokens"].shape, generator=torch.Generator().manual_seed(50 + i)) - 2
            for i, mb in enumerate(mbs)]


def step_losses(name, monkeypatch):
    """The RL step's advantages and per-micro-batch policy losses for ``name`` (no model: the loss function the
    optimizer step would run is called on fixed logits)."""
    alg = config(name)
    batch = prepare_batch(samples(), dp_rank=0, dp_size=1, pad_multiple=1, max_tokens=24, vocab_size=V, device="cpu")
    baseline = adv_lib.RunningMeanBaseline(momentum=0.5) if name == "sao_running_mean" else None
    if baseline is not None:
        baseline.update(torch.tensor([0.1, 0.3]))
        baseline.update(torch.tensor([0.9]))
    batch = dataclasses.replace(batch, outcome_advantages=rl_step.outcome_advantages(batch, alg, baseline))
    values = [torch.randn(mb["tokens"].shape, generator=torch.Generator().manual_seed(7 + i))
              for i, mb in enumerate(batch.microbatches)] if SPEC[name][0] == "gae" else None
    batch = rl_step.attach_advantages(batch, alg, values)
    losses = []

    def fake_step(ddp, optimizer, scheduler, mbs, loss_fn, *, ctx):
        losses.extend(loss_fn(logits_of(mb, i), mb)[1]["actor/pg_loss"] for i, mb in enumerate(mbs))
        return UpdateResult(applied=True, loss=0.0, grad_norm=1.0, lr=1.0, outputs=[])

    monkeypatch.setattr(rl_step, "optimizer_step", fake_step)
    monkeypatch.setattr(rl_step, "compute_logprobs", lambda chunks, mbs, **kw: old_logprobs_of(mbs))
    ctx = types.SimpleNamespace(tp_group=None, device=torch.device("cpu"), dp_group=None)
    actor = types.SimpleNamespace(chunks=None, ddp=None, optimizer=None, scheduler=None)
    rl_step.actor_update(actor, batch, alg, rl_step.PolicySettings(vocab_size=V, temperature=1.0, entropy_coef=0.0),
                         ctx=ctx)
    return batch, values, baseline, losses


@pytest.mark.parametrize("name", sorted(SPEC))
def test_the_table_says_what_each_objective_is(name):
    row = OBJECTIVES[name]
    assert (row.advantages.section, row.loss.section, row.ratio_against) == SPEC[name]
    assert row.critic == (SPEC[name][0] == "gae") and row.grouped == (SPEC[name][0] == "group")
    assert row.loss.fn is LOSS_FN[SPEC[name][1]]


@pytest.mark.parametrize("name", sorted(SPEC))
def test_the_step_runs_the_rows_functions_with_its_sections_knobs(name, monkeypatch):
    est, loss, behaviour = SPEC[name]
    batch, values, baseline, losses = step_losses(name, monkeypatch)
    rewards = batch.full["rewards"].float()
    if est == "group":
        outcome = adv_lib.grpo_advantages(rewards, batch.full["group_id"], normalize_std=False)
    elif est == "running_mean":
        outcome = rewards - (0.5 * 0.2 + 0.5 * 0.9)  # the baseline before this batch: EMA of the batch means
        assert baseline.value == pytest.approx(0.5 * 0.55 + 0.5 * float(rewards.double().mean()))
    old = old_logprobs_of(batch.microbatches)
    assert len(losses) == len(batch.microbatches)
    for i, mb in enumerate(batch.microbatches):
        mask = mb["action_mask"]
        if est == "gae":
            adv, _ = adv_lib.gae(mb["token_rewards"], values[i], mask, gamma=0.9, lam=0.8, skip_observations=False)
        else:
            adv = outcome[mb["row"]][:, None] * mask
        assert torch.allclose(mb["advantages"], adv.to(mb["advantages"].dtype), atol=1e-6)
        lp, _ = rl_step.token_logprobs(logits_of(mb, i), mb["tokens"], tp_group=None, vocab_size=V)
        ref, _ = LOSS_FN[loss](lp, old[i] if behaviour == "old_logprobs" else mb["rollout_logprobs"],
                               mb["advantages"], mask, num_tokens=batch.num_tokens, **KNOBS[loss])
        assert torch.equal(losses[i], ref.detach()), (losses[i], ref)


def test_a_changed_knob_reaches_the_loss(monkeypatch):
    *_, knobbed = step_losses("sao", monkeypatch)
    KNOBS["dis"]["eps_high"] = 5.0
    try:
        *_, default = step_losses("sao", monkeypatch)
    finally:
        KNOBS["dis"]["eps_high"] = 0.4
    assert any(not torch.equal(a, b) for a, b in zip(knobbed, default))


@pytest.mark.parametrize("section", ["dis", "ppo_clip"])
def test_each_loss_reports_the_metrics_its_row_names(section):
    g = torch.Generator().manual_seed(3)
    lp, behaviour, adv = (torch.randn(4, 6, generator=g) for _ in range(3))
    mask = torch.ones(4, 6)
    knobs = KNOBS[section] | ({"dual_clip": 1.5} if section == "ppo_clip" else {})
    _, metrics = LOSS_FN[section](lp, behaviour, adv, mask, num_tokens=24, **knobs)
    ours = set(next(p.logs for p in (o.loss for o in OBJECTIVES.values()) if p.section == section))
    others = {k for o in OBJECTIVES.values() if o.loss.section != section for k in o.loss.logs}
    assert ours <= set(metrics) and not others & set(metrics), (ours, others, sorted(metrics))
