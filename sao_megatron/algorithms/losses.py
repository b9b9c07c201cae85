"""Policy and value losses: DIS (SAO), PPO/GRPO clip, clipped value loss, loss aggregation.

Pure tensor maths (docs/architecture.md#the-algorithm). Per-token inputs are ``[B, T]``; only tokens with
``action_mask == 1`` enter a loss. Normalisation comes in from outside: ``num_tokens`` (global
action-token count) or ``num_sequences`` (global sample count) is the denominator over the whole
global batch, so summing the losses of every micro-batch on every rank gives the global loss and
the all-reduce stays in ``training/``. Every loss returns ``(loss, metrics)``: ``loss`` is a 0-dim
tensor with gradient, ``metrics`` a flat ``group/name`` dict of detached 0-dim tensors
(``actor/pg_loss`` and ``critic/vf_loss`` are this call's share of the global loss; the others are
statistics over this call's tokens, see ``metrics.py``).
"""

from __future__ import annotations

import math

import torch

from sao_megatron.algorithms.metrics import importance_ratio_metrics, masked_mean, value_metrics

__all__ = ["AGG_MODES", "aggregate_loss", "dis_policy_loss", "ppo_clip_policy_loss", "value_loss"]

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
# PPO clamps the log-ratio before exp (verl does the same with 20): e^20 ~ 5e8 keeps the loss finite
# for any log-prob gap; such tokens are far outside any clip range, where the gradient is 0 anyway
# except for negative advantages without dual clip (then it stops growing at e^20).
_PPO_MAX_LOG_RATIO = 20.0

Count = int | float | torch.Tensor


def _bool_mask(action_mask: torch.Tensor) -> torch.Tensor:
    return action_mask if action_mask.dtype == torch.bool else action_mask != 0


def _check_count(name: str, count: Count | None, agg: str) -> Count:
    if count is None:
        raise ValueError(f"agg={agg!r} needs the global {name} (summed over every micro-batch and rank); pass {name}=...")
    if not isinstance(count, torch.Tensor) and not count > 0:
        raise ValueError(f"{name} must be > 0, got {count}; it is the global denominator of the loss")
    return count


def _check_shapes(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"expected tensors of one [B, T] shape, got {shapes}")


def aggregate_loss(per_token: torch.Tensor, action_mask: torch.Tensor, *, agg: str = "token_mean",
                   num_tokens: Count | None = None, num_sequences: Count | None = None) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to this call's share of the global loss (0-dim).

    ``token_mean``: ``Σ_{b,t} m·ℓ / num_tokens`` (num_tokens = global action tokens).
    ``seq_mean_token_mean``: ``Σ_b (Σ_t m·ℓ / max(1, Σ_t m)) / num_sequences``.
    ``seq_mean_token_sum``: ``Σ_b Σ_t m·ℓ / num_sequences`` (num_sequences = global samples).
    Values outside the mask are ignored even if NaN/inf (and receive zero gradient).
    """
    mask = _bool_mask(action_mask)
    masked = torch.where(mask, per_token, 0.0)
    if agg == "token_mean":
        return masked.sum() / _check_count("num_tokens", num_tokens, agg)
    if agg == "seq_mean_token_mean":
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_seq.sum() / _check_count("num_sequences", num_sequences, agg)
    if agg == "seq_mean_token_sum":
        return masked.sum() / _check_count("num_sequences", num_sequences, agg)
    raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {AGG_MODES}")


def dis_policy_loss(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, advantages: torch.Tensor,
                    action_mask: torch.Tensor, *, eps_low: float, eps_high: float, num_tokens: Count | None,
                    agg: str = "token_mean", num_sequences: Count | None = None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Direct double-sided importance sampling policy loss (SAO, docs/architecture.md#dis-policy-loss).

    logprobs: ``[B, T]`` log π_θ(y_t) (with gradient); rollout_logprobs: ``[B, T]`` log-probs the
    engine returned when it generated y_t; advantages ``[B, T]``. No old-policy forward pass:
    ``r = exp(logπ_θ − logπ_rollout)``, ``keep = mask·[1 − eps_low ≤ r ≤ 1 + eps_high]`` (no gradient
    through keep), loss ``= −Σ keep·r·Â / N`` with N from ``agg`` (``num_tokens`` for token_mean).
    The band test runs on the exact log-ratio (``log r < log(1 − eps_low)``), and the exp only ever
    sees kept log-ratios (others become 0), so any log-prob gap gives a finite loss and masked
    tokens get exactly zero gradient. Paper settings: math 0.3/5.0, coding 0.8/3.0.
    Metrics: ``actor/pg_loss``, ``actor/dis_masked_{low,high}_frac`` (fraction of action tokens
    below/above the band), ratio/KL/ESS statistics (``importance_ratio_metrics``).
    """
    _check_shapes(logprobs=logprobs, rollout_logprobs=rollout_logprobs, advantages=advantages,
                  action_mask=action_mask)
    if not (0.0 <= eps_low <= 1.0 and eps_high >= 0.0):
        raise ValueError(f"DIS band needs 0 <= eps_low <= 1 and eps_high >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    mask = _bool_mask(action_mask)
    log_ratio = logprobs - rollout_logprobs.detach()
    with torch.no_grad():
        lower = math.log(1.0 - eps_low) if eps_low < 1.0 else float("-inf")
        below = mask & (log_ratio < lower)
        above = mask & (log_ratio > math.log1p(eps_high))
        keep = mask & ~below & ~above
    ratio = torch.exp(torch.where(keep, log_ratio, 0.0))
    per_token = torch.where(keep, -ratio * advantages.detach(), 0.0)
    loss = aggregate_loss(per_token, mask, agg=agg, num_tokens=num_tokens, num_sequences=num_sequences)
    metrics = {"actor/pg_loss": loss.detach(), "actor/dis_masked_low_frac": masked_mean(below.double(), mask),
               "actor/dis_masked_high_frac": masked_mean(above.double(), mask)}
    metrics.update(importance_ratio_metrics(log_ratio, mask))
    return loss, metrics


def ppo_clip_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                         action_mask: torch.Tensor, *, clip_low: float, clip_high: float, num_tokens: Count | None,
                         agg: str = "token_mean", num_sequences: Count | None = None,
                         dual_clip: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (the GRPO/PPO baselines), optionally dual-clipped.

    ``r = exp(logπ_θ − logπ_old)``; per token ``ℓ = max(−Â·r, −Â·clip(r, 1 − clip_low, 1 + clip_high))``
    (Schulman et al. 2017, asymmetric "clip-higher" bounds as in DAPO). ``dual_clip = c > 1``
    (Ye et al. 2020): for ``Â < 0`` also ``ℓ = min(ℓ, −c·Â)``, bounding the loss of a token whose
    ratio exploded. old_logprobs: recomputed old-policy log-probs (GRPO) or rollout log-probs (PPO).
    Metrics: ``actor/pg_loss``, ``actor/clip_frac``, ``actor/clip_frac_dual`` (with dual clip)
    and the ratio/KL/ESS statistics.
    """
    _check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, action_mask=action_mask)
    if not (0.0 <= clip_low <= 1.0 and clip_high >= 0.0):
        raise ValueError(f"PPO clip needs 0 <= clip_low <= 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (typically 3) or None, got {dual_clip}")
    mask = _bool_mask(action_mask)
    # Padding may hold -inf/NaN log-probs; zero it first so no NaN reaches a gradient (0·NaN = NaN).
    log_ratio = torch.where(mask, logprobs - old_logprobs.detach(), 0.0)
    ratio = torch.exp(log_ratio.clamp(-_PPO_MAX_LOG_RATIO, _PPO_MAX_LOG_RATIO))
    adv = torch.where(mask, advantages.detach(), 0.0)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    metrics = {"actor/clip_frac": masked_mean((clipped > unclipped).double(), mask)}
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual_hit = (adv < 0) & (per_token > bound)
        per_token = torch.where(dual_hit, bound, per_token)
        metrics["actor/clip_frac_dual"] = masked_mean(dual_hit.double(), mask)
    loss = aggregate_loss(per_token, mask, agg=agg, num_tokens=num_tokens, num_sequences=num_sequences)
    metrics["actor/pg_loss"] = loss.detach()
    metrics.update(importance_ratio_metrics(log_ratio, mask))
    return loss, metrics


def value_loss(values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor, *,
               num_tokens: Count | None, old_values: torch.Tensor | None = None, clip: float | None = None,
               agg: str = "token_mean", num_sequences: Count | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss ``½(V − G)²`` over action tokens (docs/architecture.md#critic), optionally clipped.

    values: ``[B, T]`` critic outputs (with gradient); returns: GAE returns G (targets, detached).
    ``clip = ε``: ``V_clip = V_old + clip(V − V_old, −ε, ε)`` and ``ℓ = ½ max((V − G)², (V_clip − G)²)``
    (PPO2 value clipping; needs ``old_values``, the critic's outputs at rollout time; ignored
    without ``clip``). Metrics: ``critic/vf_loss``, ``critic/vf_clipfrac`` (with clip) and
    ``value_metrics`` (values statistics, absolute error, explained variance).
    """
    _check_shapes(values=values, returns=returns, action_mask=action_mask)
    mask = _bool_mask(action_mask)
    target = returns.detach()
    # Masked first: a NaN at a padded position would otherwise reach the gradient as 0·NaN.
    per_token = 0.5 * torch.where(mask, values - target, 0.0) ** 2
    metrics = {}
    if clip is not None:
        if old_values is None:
            raise ValueError("value_loss(clip=...) needs old_values (the critic's values at rollout time); "
                             "pass them or set clip=None")
        if not clip > 0:
            raise ValueError(f"value clip must be > 0 or None, got {clip}")
        _check_shapes(values=values, old_values=old_values)
        old = old_values.detach()
        clipped = 0.5 * torch.where(mask, old + (values - old).clamp(-clip, clip) - target, 0.0) ** 2
        metrics["critic/vf_clipfrac"] = masked_mean((clipped > per_token).double(), mask)
        per_token = torch.maximum(per_token, clipped)
    loss = aggregate_loss(per_token, mask, agg=agg, num_tokens=num_tokens, num_sequences=num_sequences)
    metrics["critic/vf_loss"] = loss.detach()
    metrics.update(value_metrics(values, returns, mask))
    return loss, metrics
