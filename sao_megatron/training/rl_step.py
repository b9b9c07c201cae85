"""One RL update on a batch of finished samples: advantages, actor step, K critic steps.

Everything here runs on every trainer rank with the same batch (rank 0's
scheduler broadcasts it). Each data-parallel rank trains on its shard; the
global counts that normalise the losses (action tokens, sequences) are taken
from the whole batch, so gradients summed over micro-batches and DP ranks are
exactly the global-batch objective (Megatron's ``calculate_per_token_loss``,
see ``training.forward``). Advantages are computed per micro-batch: GAE is a
per-row recursion, so no re-assembly of rows is needed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sao_megatron.algorithms import advantages as adv_lib
from sao_megatron.algorithms import losses as loss_lib
from sao_megatron.config import AlgorithmConfig
from sao_megatron.models.actor import token_logprobs
from sao_megatron.models.critic import token_values
from sao_megatron.training.forward import MicroBatch, compute_logprobs, compute_values, forward_backward
from sao_megatron.training.microbatch import plan_microbatches, slice_padded
from sao_megatron.training.optim import zero_grads

log = logging.getLogger(__name__)

CRITIC_ALGORITHMS = {"sao", "ppo"}
GROUP_ALGORITHMS = {"grpo", "grpo_dis"}
PER_TOKEN_KEYS = ("tokens", "action_mask", "rollout_logprobs", "token_rewards", "versions")


@dataclass(kw_only=True, slots=True)
class LocalBatch:
    """This rank's micro-batches plus the global counts that normalise every loss."""

    microbatches: list[MicroBatch]
    """Per micro-batch: tokens, action_mask (float), rollout_logprobs, token_rewards, versions, ... [b, s]."""
    num_tokens: int
    """Action tokens in the whole global batch (all DP ranks)."""
    num_sequences: int
    """Samples in the whole global batch."""
    outcome_advantages: torch.Tensor | None = None
    """Per-sample advantages [B_global] for outcome-only algorithms (grpo*, running mean)."""
    stats: dict[str, float] = field(default_factory=dict)
    """Batch statistics known before the update (reward, lengths)."""


def check_token_ids(tokens: torch.Tensor, vocab_size: int) -> None:
    """Every token id of a batch is a real vocabulary entry (the engines sample from the same model).

    An id outside ``[0, vocab_size)`` means the engines serve a different model or tokenizer than
    ``model.vocab_size`` describes; its log-prob would be -inf, so stop before training on it.
    """
    if tokens.numel() == 0:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        from sao_megatron.errors import SaoError

        bad = high if high >= vocab_size else low
        raise SaoError(f"a rollout holds token id {bad}, outside model.vocab_size={vocab_size}: the engines serve "
                       "a model or tokenizer other than the configured one; point them at the trainer's weights "
                       "(model.hf_dir) or set model.vocab_size to the checkpoint's vocabulary")


def build_local_batch(full: dict[str, Any], *, dp_rank: int, dp_size: int, max_tokens: int,
                      pad_multiple: int) -> LocalBatch:
    """Split the collated global batch over DP (round-robin over length-sorted rows) into micro-batches."""
    seq_lens = full["seq_lens"].tolist()
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    mine = order[dp_rank::dp_size]
    tensors = {k: full[k] for k in PER_TOKEN_KEYS}
    tensors["action_mask"] = tensors["action_mask"].float()
    tensors["row"] = torch.arange(len(seq_lens))[:, None].expand(-1, full["tokens"].shape[1]).contiguous()
    plan = plan_microbatches([seq_lens[i] for i in mine], max_tokens=max_tokens, pad_multiple=pad_multiple)
    mbs = [slice_padded(tensors, [mine[j] for j in group], s) for group, s in zip(plan.indices, plan.seq_lengths)]
    for mb in mbs:
        mb["row"] = mb["row"][:, 0].contiguous()  # global sample index per row
    return LocalBatch(microbatches=mbs, num_tokens=int(full["action_mask"].sum()),
                      num_sequences=len(seq_lens))


def outcome_advantages(full: dict[str, Any], alg: AlgorithmConfig,
                       baseline: adv_lib.RunningMeanBaseline | None) -> torch.Tensor | None:
    """Per-sample advantages for critic-free algorithms, from the whole batch (groups span DP ranks)."""
    rewards = full["rewards"].float()
    if alg.name in GROUP_ALGORITHMS:
        return adv_lib.grpo_advantages(rewards, full["group_id"], normalize_std=alg.normalize_group_std)
    if alg.name == "sao_running_mean":
        assert baseline is not None
        out = baseline.advantages(rewards)
        baseline.update(rewards)
        return out
    return None


def attach_advantages(batch: LocalBatch, alg: AlgorithmConfig, values: Sequence[torch.Tensor] | None) -> None:
    """Fill ``advantages`` (and ``returns``/``old_values`` with a critic) into every micro-batch."""
    for i, mb in enumerate(batch.microbatches):
        mask = mb["action_mask"]
        if values is not None:
            v = values[i] * mask
            adv, ret = adv_lib.gae(mb["token_rewards"], v, mask, gamma=alg.gamma, lam=alg.lam,
                                   skip_observations=alg.gae == "skip_observation")
            mb["advantages"], mb["returns"], mb["old_values"] = adv, ret, v
        else:
            assert batch.outcome_advantages is not None
            mb["advantages"] = batch.outcome_advantages[mb["row"]][:, None] * mask


def policy_loss(alg: AlgorithmConfig, lp: torch.Tensor, mb: MicroBatch, counts: dict[str, int]):
    """The configured policy objective on one micro-batch, normalised by global counts."""
    common = dict(num_tokens=counts["num_tokens"], agg=alg.loss_agg, num_sequences=counts["num_sequences"])
    if alg.name in ("sao", "grpo_dis", "sao_running_mean"):
        return loss_lib.dis_policy_loss(lp, mb["rollout_logprobs"], mb["advantages"], mb["action_mask"],
                                        eps_low=alg.eps_low, eps_high=alg.eps_high, **common)
    old = mb["old_logprobs"] if alg.name == "grpo" else mb["rollout_logprobs"]
    return loss_lib.ppo_clip_policy_loss(lp, old, mb["advantages"], mb["action_mask"], clip_low=alg.clip_low,
                                         clip_high=alg.clip_high, dual_clip=alg.dual_clip, **common)


@dataclass(kw_only=True, slots=True)
class UpdateResult:
    """What one optimizer step did."""

    applied: bool
    """False when the step was skipped (non-finite loss or gradients)."""
    loss: float
    """Global objective value (summed over micro-batches and DP ranks)."""
    grad_norm: float | None
    """Gradient norm before clipping (None when skipped)."""
    lr: float
    """Learning rate of this step."""
    outputs: list[dict[str, torch.Tensor]]
    """loss_fn outputs per micro-batch on the last pipeline stage."""


def guarded_step(ddp_chunks, optimizer, scheduler, microbatches, loss_fn, *, ctx) -> UpdateResult:
    """Forward/backward + optimizer step, skipped on every rank if any rank saw a non-finite loss."""
    for chunk in ddp_chunks:
        chunk.train()
    zero_grads(ddp_chunks, optimizer)
    outputs = forward_backward(ddp_chunks, microbatches, loss_fn, ctx=ctx)
    local = sum(float(o["loss"]) for o in outputs) if outputs else 0.0
    stat = torch.tensor([local, 0.0 if math.isfinite(local) else 1.0], dtype=torch.float64)
    if not math.isfinite(local):
        stat[0] = 0.0
    dist.all_reduce(stat)  # loss contributions come from last-stage ranks only; TP ranks repeat them
    total = float(stat[0]) / max(ctx.tp_size, 1)
    lr = float(optimizer.param_groups[0]["lr"]) if optimizer.param_groups else 0.0
    if stat[1] > 0:
        zero_grads(ddp_chunks, optimizer)
        return UpdateResult(applied=False, loss=float("nan"), grad_norm=None, lr=lr, outputs=outputs)
    ok, grad_norm, _ = optimizer.step()
    if ok and grad_norm is not None and not math.isfinite(float(grad_norm)):
        ok = False
    if ok:
        scheduler.step(increment=1)
    return UpdateResult(applied=bool(ok), loss=total, lr=lr, outputs=outputs,
                        grad_norm=None if grad_norm is None else float(grad_norm))


def actor_update(actor, batch: LocalBatch, alg: AlgorithmConfig, *, ctx, vocab_size: int,
                 temperature: float, entropy_coef: float) -> UpdateResult:
    """One actor optimizer step over all micro-batches (DIS or PPO-clip per ``alg.name``)."""
    if alg.name == "grpo":  # PPO-clip against the policy before this update (recomputed, no grad)
        old = compute_logprobs(actor.chunks, batch.microbatches, ctx=ctx, vocab_size=vocab_size,
                               temperature=temperature)
        for mb, lp in zip(batch.microbatches, old):
            mb["old_logprobs"] = lp
    counts = {"num_tokens": batch.num_tokens, "num_sequences": batch.num_sequences}

    def loss_fn(logits, mb):
        lp, ent = token_logprobs(logits, mb["tokens"], tp_group=ctx.tp_group, vocab_size=vocab_size,
                                 temperature=temperature, with_entropy=True)
        loss, _ = policy_loss(alg, lp, mb, counts)
        entropy = (ent * mb["action_mask"]).sum() / max(batch.num_tokens, 1)
        if entropy_coef:
            loss = loss - entropy_coef * entropy
        return loss, {"loss": loss.detach(), "logprobs": lp.detach(), "entropy_sum": entropy.detach()}

    return guarded_step(actor.ddp, actor.optimizer, actor.scheduler, batch.microbatches, loss_fn, ctx=ctx)


def critic_values(critic, batch: LocalBatch, *, ctx) -> list[torch.Tensor]:
    return compute_values(critic.chunks, batch.microbatches, ctx=ctx)


def critic_update(critic, batch: LocalBatch, *, ctx, value_clip: float | None) -> UpdateResult:
    """One critic optimizer step: ½(V − G)² over action tokens (optionally clipped around old values)."""
    def loss_fn(out, mb):
        v = token_values(out)
        loss, _ = loss_lib.value_loss(v, mb["returns"], mb["action_mask"], num_tokens=batch.num_tokens,
                                      old_values=mb["old_values"] if value_clip else None, clip=value_clip)
        return loss, {"loss": loss.detach(), "values": v.detach()}

    return guarded_step(critic.ddp, critic.optimizer, critic.scheduler, batch.microbatches, loss_fn, ctx=ctx)
