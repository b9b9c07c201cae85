"""One RL update on a batch of finished samples: advantages, actor step, K critic steps.

Everything here runs on every trainer rank with the same batch (rank 0's
scheduler broadcasts it). Each data-parallel rank trains on its shard; the
global counts that normalise the losses (action tokens, sequences) are taken
from the whole batch, so gradients summed over micro-batches and DP ranks are
exactly the global-batch objective (Megatron's ``calculate_per_token_loss``,
see ``training.step.forward``). Advantages are computed per micro-batch: GAE is a
per-row recursion, so no re-assembly of rows is needed. What an objective
needs and computes (critic, estimator, loss, the ratio's behaviour log-probs) is its row in
``algorithms.objectives``: this module calls the row's functions with the knobs
``objective_knobs`` reads from the row's config sections, and never asks which objective runs.

:func:`update` is the one entry the trainer calls: it takes the models, this rank's batch and the
settings, runs the whole step in its fixed order, and returns a :class:`StepResult`. The only thing
that happens between its phases and is not the step's is ``after_actor`` (the trainer's overlapped
weight push, which overlaps the critic steps): a hook, so the order stays written here once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sao_megatron.algorithms import advantages as adv_lib
from sao_megatron.algorithms import losses as loss_lib
from sao_megatron.algorithms.metrics import advantage_stats
from sao_megatron.algorithms.objectives import Objective, objective
from sao_megatron.config import AlgorithmConfig, ExperimentConfig
from sao_megatron.models.actor import token_logprobs
from sao_megatron.models.critic import token_values
from sao_megatron.models.routing_replay import route_metrics
from sao_megatron.parallel.collectives import combine_metrics, gather_metrics
from sao_megatron.training.step.batch import LocalBatch, MicroBatch, minibatch_groups
from sao_megatron.training.step.forward import compute_logprobs, compute_values
from sao_megatron.training.step.objective_knobs import knobs
from sao_megatron.training.step.offload import resident
from sao_megatron.training.step.optim import UpdateResult, optimizer_step
from sao_megatron.training.step.step_metrics import value_metrics

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class PolicySettings:
    """What the actor's loss needs besides the algorithm section (from model/rollout/actor config)."""

    vocab_size: int
    """model.vocab_size (logits beyond it are padding)."""
    temperature: float
    """rollout.temperature: log-probs are of the tempered distribution the engines sampled."""
    entropy_coef: float
    """actor.entropy_coef."""
    ppo_epochs: int = 1
    """actor.ppo_epochs: passes over the batch."""
    num_minibatches: int = 1
    """actor.num_minibatches: optimizer steps per pass."""
    update_norm: bool = False
    """actor.log_update_norm: measure the parameter change of each batch's steps."""


@dataclass(kw_only=True, slots=True)
class StepSettings:
    """Everything :func:`update` reads from the config, read once (``from_config``)."""

    algorithm: AlgorithmConfig
    """The objective and its knobs."""
    policy: PolicySettings
    """What the actor's loss needs besides ``algorithm``."""
    value_clip: float | None = None
    """critic.value_clip."""
    critic_updates: int = 1
    """critic.num_updates_per_step: K critic optimizer steps per batch."""
    offload: bool = False
    """resources.offload_idle_optimizer: only the stepping model's optimizer state on the device."""
    routing_replay: bool = False
    """rollout.routing_replay: report how often the actor's routes differ from the engines'."""

    @classmethod
    def from_config(cls, cfg: ExperimentConfig) -> StepSettings:
        policy = PolicySettings(vocab_size=cfg.model.vocab_size, temperature=cfg.rollout.temperature,
                                entropy_coef=cfg.actor.entropy_coef, ppo_epochs=cfg.actor.ppo_epochs,
                                num_minibatches=cfg.actor.num_minibatches, update_norm=cfg.actor.log_update_norm)
        return cls(algorithm=cfg.algorithm, policy=policy, value_clip=cfg.critic.value_clip,
                   critic_updates=cfg.critic.num_updates_per_step, offload=cfg.resources.offload_idle_optimizer,
                   routing_replay=cfg.rollout.routing_replay)


@dataclass(kw_only=True, slots=True)
class StepResult:
    """What one RL step hands back to the trainer."""

    actor: UpdateResult
    """The actor's update (``applied``: its weights changed, so there is a new version to publish)."""
    critic: list[UpdateResult] = field(default_factory=list)
    """The critic's K updates (empty without a critic)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """The step's metrics: the updates' losses, norms and learning rates and the route mismatch (routing
    replay) on every rank; the policy/advantage/value metrics combined over ranks on rank 0 only."""

    @property
    def applied(self) -> bool:
        return self.actor.applied


def update(actor, critic, batch: LocalBatch, settings: StepSettings, *, ctx, baseline=None,
           after_actor: Callable[[], None] | None = None) -> StepResult:
    """Collective: one RL step on ``batch`` (every rank, its own shard of the same global batch).

    Order: outcome advantages (from the whole batch; updates ``baseline``) → the critic's values →
    advantages/returns → the actor's optimizer step(s) → ``after_actor()`` if the actor's update was
    applied (its weights are final: e.g. start a weight push that overlaps the rest) → the critic's K
    steps → metrics gathered over ranks. ``critic`` None: an outcome-only objective.
    """
    alg = settings.algorithm
    batch = dataclasses.replace(batch, outcome_advantages=outcome_advantages(batch, alg, baseline))
    batch = attach_advantages(batch, alg, critic_values(critic, batch, ctx=ctx) if critic is not None else None)
    with resident(actor, offload=settings.offload):
        policy = actor_update(actor, batch, alg, settings.policy, ctx=ctx)
    if after_actor is not None and policy.applied:
        after_actor()
    local = policy_metrics(batch, policy)
    routes = route_metrics(actor.chunks, device=ctx.device) if settings.routing_replay else {}
    values = critic_steps(critic, batch, settings, ctx=ctx) if critic is not None else []
    if critic is not None and policy.outputs:
        local |= value_metrics(batch, values)
    contributes = ctx.is_last_stage and ctx.tp_rank == 0
    metrics = gather_metrics(local if contributes else {}, rank_weight(batch))
    metrics |= summary(policy, "actor") | routes | (summary(values[-1], "critic") if critic is not None else {})
    return StepResult(actor=policy, critic=values, metrics=metrics)


def value_pretrain_step(critic, batch: LocalBatch, settings: StepSettings, *, ctx) -> list[UpdateResult]:
    """Collective: value pretraining on one batch: GAE targets from the critic's own values, then its K
    steps (the actor and the baseline untouched)."""
    batch = attach_advantages(batch, settings.algorithm, critic_values(critic, batch, ctx=ctx))
    return critic_steps(critic, batch, settings, ctx=ctx)


def critic_steps(critic, batch: LocalBatch, settings: StepSettings, *, ctx) -> list[UpdateResult]:
    """The critic's K steps, its optimizer state on the device meanwhile."""
    with resident(critic, offload=settings.offload):
        return critic_updates(critic, batch, ctx=ctx, value_clip=settings.value_clip,
                              num_updates=settings.critic_updates)


def outcome_advantages(batch: LocalBatch, alg: AlgorithmConfig,
                       baseline: adv_lib.RunningMeanBaseline | None) -> torch.Tensor | None:
    """Per-sample advantages [B_global] on the batch's device from the objective's outcome estimator
    (from the whole batch: groups span DP ranks); None where the estimator is token-level on a critic's
    values (``attach_advantages`` runs it per micro-batch)."""
    est = objective(alg.name).advantages
    if est.per_token:
        return None
    rewards = batch.full["rewards"].float()
    out = est.fn(rewards, batch.full["group_id"], **knobs(alg, est.section, baseline=baseline))
    return out.to(batch.device)


def attach_advantages(batch: LocalBatch, alg: AlgorithmConfig, values: Sequence[torch.Tensor] | None
                      ) -> LocalBatch:
    """A new batch whose micro-batches carry ``advantages`` (and ``returns``/``old_values``/``value_mask``
    with a critic's ``values``, [b, s] per micro-batch), with ``value_mask`` [B_global, L] (its sum
    normalises the value loss). Without values: ``batch.outcome_advantages`` on every action token.

    The critic's values enter GAE unmasked: skip-observation GAE reads them only at action tokens,
    plain token-level GAE also at observation tokens (their own values, as standard GAE does), and
    then the value loss covers those observation steps too (``adv_lib.gae_value_mask``).
    """
    if values is None:  # an outcome estimator: the per-sample advantages on every action token
        assert batch.outcome_advantages is not None, "outcome_advantages runs first"
        mbs = [mb.with_(advantages=batch.outcome_advantages[mb.row][:, None] * mb.action_mask)
               for mb in batch.microbatches]
        return dataclasses.replace(batch, microbatches=mbs)
    est = objective(alg.name).advantages
    assert est.per_token, f"algorithm.name={alg.name} has no critic to take values from"
    gae_knobs = knobs(alg, est.section)
    skip = gae_knobs["skip_observations"]
    mbs = []
    for mb, v in zip(batch.microbatches, values, strict=True):
        mask = mb.action_mask
        adv, ret = est.fn(mb.token_rewards, v, mask, **gae_knobs)
        value_mask = mask if skip else adv_lib.gae_value_mask(mask, skip_observations=False).to(mask.dtype)
        mbs.append(mb.with_(advantages=adv, returns=ret, old_values=v * value_mask, value_mask=value_mask))
    full_mask = adv_lib.gae_value_mask(batch.full["action_mask"], skip_observations=skip)
    return dataclasses.replace(batch, microbatches=mbs, value_mask=full_mask)


def policy_loss(obj: Objective, alg: AlgorithmConfig, lp: torch.Tensor, mb: MicroBatch, counts: dict[str, int]):
    """The objective's policy loss on one micro-batch (ratio against its behaviour log-probs), normalised
    by global counts."""
    return obj.loss.fn(lp, mb[obj.ratio_against], mb.advantages, mb.action_mask, num_tokens=counts["num_tokens"],
                       agg=alg.loss_agg, num_sequences=counts["num_sequences"], **knobs(alg, obj.loss.section))


def actor_update(actor, batch: LocalBatch, alg: AlgorithmConfig, settings: PolicySettings, *, ctx) -> UpdateResult:
    """The actor's optimizer steps on one batch: ``ppo_epochs`` passes of ``num_minibatches`` steps
    (1 x 1 by default: SAO's single step). Each mini-batch's loss is normalised by its own global
    counts. ``outputs`` of every step carry the loss's own metrics (DIS band, ratio/KL/ESS, clip
    fractions), ``entropy`` and ``num_action_tokens`` (their weight when combined).
    """
    obj = objective(alg.name)
    if obj.needs_old_logprobs:  # the policy before this batch's first step (recomputed, no grad)
        old = compute_logprobs(actor.chunks, batch.microbatches, ctx=ctx, vocab_size=settings.vocab_size,
                               temperature=settings.temperature)
        mbs = [mb.with_(old_logprobs=lp) for mb, lp in zip(batch.microbatches, old, strict=True)]
        batch = dataclasses.replace(batch, microbatches=mbs)
    groups = minibatch_groups(batch, settings.num_minibatches)
    counts = _global_counts(batch, groups, ctx)
    before = param_snapshot(actor.chunks) if settings.update_norm else None
    results = []
    for _ in range(settings.ppo_epochs):
        for idx, count in zip(groups, counts):
            mbs = [batch.microbatches[i] for i in idx]
            results.append(optimizer_step(actor.ddp, actor.optimizer, actor.scheduler, mbs,
                                          _policy_loss_fn(obj, alg, settings, count, ctx), ctx=ctx))
    result = _combine(results)
    if before is not None:
        result.update_norm = update_norm(actor.chunks, before)
    return result


def param_snapshot(chunks: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
    """A copy of this rank's trainable parameters (``update_norm`` compares against it)."""
    return [p.detach().clone() for c in chunks for p in c.parameters() if p.requires_grad]


def update_norm(chunks: Sequence[torch.nn.Module], before: list[torch.Tensor]) -> float:
    """``‖θ_now − θ_before‖`` over this rank's trainable parameters, in float64."""
    now = [p.detach() for c in chunks for p in c.parameters() if p.requires_grad]
    sq = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(now, before, strict=True))
    return sq ** 0.5


def _policy_loss_fn(obj: Objective, alg: AlgorithmConfig, settings: PolicySettings, counts: dict[str, int], ctx):
    def loss_fn(logits, mb):
        lp, ent = token_logprobs(logits, mb.tokens, tp_group=ctx.tp_group, vocab_size=settings.vocab_size,
                                 temperature=settings.temperature, with_entropy=True)
        loss, metrics = policy_loss(obj, alg, lp, mb, counts)
        mask = mb.action_mask
        if settings.entropy_coef:
            loss = loss - settings.entropy_coef * (ent * mask).sum() / max(counts["num_tokens"], 1)
        local_tokens = mask.sum()
        metrics["actor/entropy"] = (ent.detach() * mask).sum() / local_tokens.clamp(min=1)
        metrics["actor/num_action_tokens"] = local_tokens
        return loss, {"loss": loss.detach(), **metrics}

    return loss_fn


def _global_counts(batch: LocalBatch, groups: list[list[int]], ctx) -> list[dict[str, int]]:
    """Action tokens and sequences of each mini-batch over all DP ranks (the loss denominators)."""
    if len(groups) == 1:
        return [{"num_tokens": batch.num_tokens, "num_sequences": batch.num_sequences}]
    local = torch.tensor([[float(sum(batch.microbatches[i].action_mask.sum() for i in idx)),
                           float(sum(batch.microbatches[i].tokens.shape[0] for i in idx))] for idx in groups],
                         dtype=torch.float64, device=ctx.device)
    dist.all_reduce(local, group=ctx.dp_group)  # on the device: NCCL reduces device tensors only
    return [{"num_tokens": int(t), "num_sequences": int(n)} for t, n in local.tolist()]


def _combine(results: list[UpdateResult]) -> UpdateResult:
    """One result for the batch: applied if any step was, the mean loss, the last norm and LR, and
    every step's outputs (metrics then cover all steps)."""
    if len(results) == 1:
        return results[0]
    finite = [r.loss for r in results if r.applied]
    return UpdateResult(applied=bool(finite), loss=sum(finite) / len(finite) if finite else float("nan"),
                        grad_norm=results[-1].grad_norm, lr=results[-1].lr,
                        outputs=[o for r in results for o in r.outputs],
                        scaler_skip=any(r.scaler_skip for r in results))


def critic_values(critic, batch: LocalBatch, *, ctx) -> list[torch.Tensor]:
    return compute_values(critic.chunks, batch.microbatches, ctx=ctx)


def critic_update(critic, batch: LocalBatch, *, ctx, value_clip: float | None) -> UpdateResult:
    """One critic optimizer step: ½(V − G)² over the value-mask tokens (``attach_advantages``: the
    action tokens, plus the observation steps with plain token GAE), optionally clipped around old values."""
    assert batch.value_mask is not None, "attach_advantages with the critic's values runs first"
    num_tokens = int(batch.value_mask.sum())

    def loss_fn(out, mb):
        v = token_values(out)
        loss, _ = loss_lib.value_loss(v, mb.returns, mb.value_mask, num_tokens=num_tokens,
                                      old_values=mb.old_values if value_clip else None, clip=value_clip)
        return loss, {"loss": loss.detach()}

    return optimizer_step(critic.ddp, critic.optimizer, critic.scheduler, batch.microbatches, loss_fn, ctx=ctx)


def critic_updates(critic, batch: LocalBatch, *, ctx, num_updates: int, value_clip: float | None
                   ) -> list[UpdateResult]:
    """The critic's K optimizer steps on one batch ("faster value update", paper §3.2)."""
    return [critic_update(critic, batch, ctx=ctx, value_clip=value_clip) for _ in range(num_updates)]


def policy_metrics(batch: LocalBatch, result: UpdateResult) -> dict[str, float]:
    """This rank's policy metrics: the loss's own (combined over micro-batches, token-weighted) plus
    advantage statistics. Empty where no loss ran (non-last pipeline stages)."""
    if not result.outputs:
        return {}
    parts = [({k: v for k, v in o.items() if k.startswith("actor/")}, float(o["actor/num_action_tokens"]))
             for o in result.outputs]
    out = combine_metrics(parts)
    adv = [mb.advantages[mb.action_mask > 0] for mb in batch.microbatches]
    flat = torch.cat(adv)[None] if adv else torch.zeros(1, 0)
    out |= {k: float(v) for k, v in advantage_stats(flat, torch.ones_like(flat)).items()}
    return out


def rank_weight(batch: LocalBatch) -> float:
    """This rank's action tokens: its weight when per-rank metrics are combined."""
    return float(sum(float(mb.action_mask.sum()) for mb in batch.microbatches))


def summary(result: UpdateResult, prefix: str) -> dict[str, Any]:
    """The step-level numbers every rank agrees on."""
    out = {f"{prefix}/loss": result.loss, f"{prefix}/lr": result.lr}
    if prefix == "actor":
        out |= {"actor/grad_norm": result.grad_norm or 0.0, "actor/update_applied": float(result.applied),
                "actor/scaler_skip": float(result.scaler_skip)}
        if result.update_norm is not None:
            out["actor/update_norm"] = result.update_norm
    return out
