"""Pure tensor maths of the RL objective: advantages, losses, metrics (no Megatron, no torch.distributed)."""

from sao_megatron.algorithms.advantages import (
    RunningMeanBaseline, broadcast_outcome_advantages, discounted_reverse_cumsum, gae, grpo_advantages,
    running_mean_advantages, running_mean_baseline,
)
from sao_megatron.algorithms.losses import AGG_MODES, aggregate_loss, dis_policy_loss, ppo_clip_policy_loss, value_loss
from sao_megatron.algorithms.metrics import (
    advantage_stats, explained_variance, importance_ratio_metrics, masked_max, masked_mean, masked_min, masked_std,
    masked_sum, return_stats, value_metrics,
)

__all__ = [
    "AGG_MODES", "RunningMeanBaseline", "advantage_stats", "aggregate_loss", "broadcast_outcome_advantages",
    "dis_policy_loss", "discounted_reverse_cumsum", "explained_variance", "gae", "grpo_advantages",
    "importance_ratio_metrics", "masked_max", "masked_mean", "masked_min", "masked_std", "masked_sum",
    "ppo_clip_policy_loss", "return_stats", "running_mean_advantages", "running_mean_baseline", "value_loss",
    "value_metrics",
]
