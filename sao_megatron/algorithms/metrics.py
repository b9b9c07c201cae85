"""Diagnostics of the RL objective: flat ``group/name`` dicts of detached 0-dim tensors.

Nothing here syncs with the host, so a training step can compute every metric and read them all
back with one transfer. Statistics are over the tokens of the call (a micro-batch on one rank);
``training/`` reduces them across micro-batches and ranks. Every function returns 0 rather than
NaN for an empty mask (no action tokens), except ``explained_variance`` (see there).
"""

from __future__ import annotations

import torch

__all__ = [
    "advantage_stats", "explained_variance", "importance_ratio_metrics", "masked_max", "masked_mean",
    "masked_min", "masked_std", "masked_sum", "return_stats", "value_metrics",
]

# Log-ratios are clamped to this before exp in the metrics (float64): exp(80)**2 ~ 3e69 keeps the
# ESS sums finite, and a ratio of e^80 already says everything about that token.
_METRIC_MAX_LOG_RATIO = 80.0


def _bool_mask(action_mask: torch.Tensor) -> torch.Tensor:
    return action_mask if action_mask.dtype == torch.bool else action_mask != 0


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` (NaN/inf outside the mask are ignored). Shapes ``[B, T]`` -> ``[]``."""
    return torch.where(_bool_mask(mask), x, 0.0).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over the mask; 0 for an empty mask."""
    mask = _bool_mask(mask)
    return masked_sum(x, mask) / mask.sum().clamp(min=1)


def masked_std(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population std of ``x`` over the mask; 0 for an empty mask."""
    mask = _bool_mask(mask)
    centred = x - masked_mean(x, mask)
    return masked_mean(centred * centred, mask).sqrt()


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of ``x`` over the mask; 0 for an empty mask."""
    mask = _bool_mask(mask)
    value = torch.where(mask, x, float("-inf")).max() if x.numel() else x.new_zeros(())
    return torch.where(mask.any(), value, 0.0)


def masked_min(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Min of ``x`` over the mask; 0 for an empty mask."""
    return -masked_max(-x, mask)


def _stats(x: torch.Tensor, mask: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    x = x.detach()
    return {f"{prefix}/mean": masked_mean(x, mask), f"{prefix}/std": masked_std(x, mask),
            f"{prefix}/max": masked_max(x, mask), f"{prefix}/min": masked_min(x, mask)}


def importance_ratio_metrics(log_ratio: torch.Tensor, action_mask: torch.Tensor, *,
                             prefix: str = "actor") -> dict[str, torch.Tensor]:
    """Ratio statistics, KL estimators and effective sample size of ``r = π_θ / π_behaviour``.

    log_ratio: ``[B, T]`` = ``logπ_θ(y_t) − logπ_behaviour(y_t)`` (behaviour: the rollout engine
    for DIS, the old policy for PPO). The tokens were sampled from the behaviour policy ``q``, so
    with ``p = π_θ`` (Schulman, "Approximating KL divergence", 2020): ``k1 = −log r`` and
    ``k3 = (r − 1) − log r`` both estimate ``KL(q ‖ p)``; k3 is unbiased and never negative.
    ``ess = (Σ r)² / (n Σ r²)`` is the effective sample size as a fraction of the n action tokens
    (1: on-policy). Computed in float64 on clamped log-ratios, so gaps of ±50 stay finite.
    """
    mask = _bool_mask(action_mask)
    lr = torch.where(mask, log_ratio.detach().double(), 0.0).clamp(-_METRIC_MAX_LOG_RATIO, _METRIC_MAX_LOG_RATIO)
    ratio = lr.exp()
    ratio_sum = masked_sum(ratio, mask)
    ess = ratio_sum * ratio_sum / (mask.sum() * masked_sum(ratio * ratio, mask)).clamp(min=1e-300)
    return {
        f"{prefix}/ratio_mean": masked_mean(ratio, mask), f"{prefix}/ratio_max": masked_max(ratio, mask),
        f"{prefix}/ratio_min": masked_min(ratio, mask), f"{prefix}/kl_k1": masked_mean(-lr, mask),
        f"{prefix}/kl_k3": masked_mean(ratio - 1.0 - lr, mask), f"{prefix}/ess": ess,
        f"{prefix}/num_action_tokens": mask.sum(),
    }


def explained_variance(values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """``1 − Var(G − V) / Var(G)`` over action tokens (1: perfect critic, 0: no better than a constant).

    NaN when ``Var(G) == 0`` (e.g. one token, or every return equal): the quantity is undefined and a
    made-up number would be worse in a dashboard.
    """
    mask = _bool_mask(action_mask)
    values, returns = values.detach().double(), returns.detach().double()
    var_returns = masked_std(returns, mask) ** 2
    var_error = masked_std(returns - values, mask) ** 2
    return torch.where(var_returns > 0, 1.0 - var_error / var_returns, float("nan"))


def advantage_stats(advantages: torch.Tensor, action_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``advantages/{mean,std,max,min}`` over action tokens."""
    return _stats(advantages, action_mask, "advantages")


def return_stats(returns: torch.Tensor, action_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``returns/{mean,std,max,min}`` over action tokens."""
    return _stats(returns, action_mask, "returns")


def value_metrics(values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor, *,
                  prefix: str = "critic") -> dict[str, torch.Tensor]:
    """Critic diagnostics: value statistics, mean absolute error and explained variance."""
    values = values.detach()
    metrics = {f"{prefix}/values_{k.split('/')[-1]}": v for k, v in _stats(values, action_mask, "v").items()}
    metrics[f"{prefix}/value_abs_error"] = masked_mean((values - returns.detach()).abs(), action_mask)
    metrics[f"{prefix}/explained_var"] = explained_variance(values, returns, action_mask)
    return metrics
