"""Per-step metrics of the critic's fit and of the batch itself.

The policy metrics are the loss's own (``rl_step.policy_metrics``); the critic's fit is
measured on its values before the K updates against the GAE returns, over this rank's
action tokens, then combined across ranks by ``parallel.collectives.gather_metrics``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from sao_megatron.algorithms import metrics as metric_lib
from sao_megatron.scheduler.sample import Sample


def _masked(batch, key: str, outputs=None, out_key: str | None = None) -> torch.Tensor:
    """All action-token values of ``key`` on this rank as one [1, N] row."""
    parts = []
    for i, mb in enumerate(batch.microbatches):
        src = outputs[i][out_key] if outputs is not None else mb[key]
        parts.append(src[mb["action_mask"] > 0].float())
    return torch.cat(parts)[None] if parts else torch.zeros(1, 0)


def value_metrics(batch, critic_results) -> dict[str, float]:
    """Critic fit on this batch (values before the K updates vs GAE returns) and the loss per update."""
    values = _masked(batch, "old_values")
    returns = _masked(batch, "returns")
    ones = torch.ones_like(values)
    out = {k: float(v) for k, v in metric_lib.return_stats(returns, ones).items()}
    out |= {k: float(v) for k, v in metric_lib.value_metrics(values, returns, ones).items()}
    for k, res in enumerate(critic_results):
        out[f"critic/loss_update{k}"] = res.loss
    return out


def batch_metrics(samples: list[Sample], full: dict[str, Any], version: int) -> dict[str, Any]:
    """Rewards, lengths and staleness of the consumed samples (identical on every rank)."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    lags = Counter()
    for s in samples:
        for v, m in zip(s.versions, s.action_mask):
            if m:
                lags[version - v] += 1
    stale = [s.staleness(version) for s in samples]
    return {
        "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std(unbiased=False)),
        "reward/max": float(rewards.max()), "reward/min": float(rewards.min()),
        "batch/num_samples": float(len(samples)), "batch/num_tokens": float(full["action_mask"].sum()),
        "batch/response_len_mean": float(sum(s.num_action_tokens for s in samples) / len(samples)),
        "batch/seq_len_max": float(full["seq_lens"].max()),
        "train/staleness_max": float(max(stale)), "train/staleness_mean": float(sum(stale) / len(stale)),
        "train/token_lag_hist": {str(k): v for k, v in sorted(lags.items())},
    }
