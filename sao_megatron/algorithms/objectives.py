"""The table of training objectives: one row per ``algorithm.name``.

Validation, the trainer and the RL step read what an objective needs from here
instead of testing name strings in several places (docs/architecture.md#baselines: "baselines kept
in the same code").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["OBJECTIVES", "Objective", "objective"]


@dataclass(frozen=True, slots=True)
class Objective:
    """What one objective needs and computes."""

    name: str
    """``algorithm.name``."""
    critic: bool
    """Needs a value model (GAE advantages)."""
    grouped: bool
    """Samples come in groups of ``algorithm.group_size`` rollouts of one prompt."""
    advantages: Literal["gae", "group", "running_mean"]
    """Advantage estimator: token-level GAE on critic values, group-normalised outcome, or outcome minus
    a running-mean baseline."""
    policy_loss: Literal["dis", "ppo_clip"]
    """DIS (ratio vs rollout log-probs, masked outside the band) or PPO clip."""
    ratio_against: Literal["rollout", "old_policy"]
    """The behaviour log-probs of the ratio: the engine's saved ones, or the policy before this batch's
    first optimizer step (recomputed; PPO-style mini-batch epochs make that clip bite)."""
    summary: str
    """One line for help texts."""


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    Objective(name="sao", critic=True, grouped=False, advantages="gae", policy_loss="dis", ratio_against="rollout",
              summary="SAO: single rollout, critic + token-level GAE, DIS against rollout log-probs"),
    Objective(name="ppo", critic=True, grouped=False, advantages="gae", policy_loss="ppo_clip",
              ratio_against="rollout", summary="PPO: critic + GAE, clip against rollout log-probs"),
    Objective(name="grpo", critic=False, grouped=True, advantages="group", policy_loss="ppo_clip",
              ratio_against="old_policy", summary="GRPO: group-normalised outcome, PPO clip against the old policy"),
    Objective(name="grpo_dis", critic=False, grouped=True, advantages="group", policy_loss="dis",
              ratio_against="rollout", summary="GRPO + DIS: group-normalised outcome, DIS against rollout log-probs"),
    Objective(name="sao_running_mean", critic=False, grouped=False, advantages="running_mean", policy_loss="dis",
              ratio_against="rollout", summary="SAO with a running-mean baseline instead of the critic"),
)}


def objective(name: str) -> Objective:
    """The row of ``name``; ValueError listing the known objectives otherwise."""
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown algorithm.name {name!r}; choose one of {sorted(OBJECTIVES)}") from None
