"""The table of training objectives: one row per ``algorithm.name``, carrying its own functions.

An objective is an advantage estimator and a policy loss, plus which log-probs the loss's ratio is
against. Each estimator and loss names the config section of its knobs (``algorithm.<section>``) and
holds its function from this package; the functions take those knobs as explicit keyword arguments
(``training.step.objective_knobs`` maps the config section to them). Validation, the trainer and the RL
step read what an objective needs from here instead of testing name strings or flags
(docs/architecture.md#baselines: "baselines kept in the same code").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from sao_megatron.algorithms import advantages as adv_lib
from sao_megatron.algorithms import losses as loss_lib

__all__ = ["ESTIMATORS", "OBJECTIVES", "POLICY_LOSSES", "Estimator", "Objective", "PolicyLoss", "objective", "users_of"]


@dataclass(frozen=True, slots=True)
class Estimator:
    """An advantage estimator and the config section of its knobs."""

    section: Literal["gae", "group", "running_mean"]
    """``algorithm.<section>`` holds its knobs."""
    per_token: bool
    """True: token-level, on a critic's values, one micro-batch at a time; False: one advantage per sample
    from the outcome rewards of the whole global batch (groups span data-parallel ranks)."""
    fn: Callable[..., Any]
    """per_token: ``fn(token_rewards [b,s], values [b,s], action_mask [b,s], **knobs) -> (advantages, returns)``;
    otherwise ``fn(outcome_rewards [B], group_ids [B], **knobs) -> advantages [B]``."""


@dataclass(frozen=True, slots=True)
class PolicyLoss:
    """A policy loss and the config section of its knobs."""

    section: Literal["dis", "ppo_clip"]
    """``algorithm.<section>`` holds its knobs."""
    fn: Callable[..., Any]
    """``fn(logprobs, behaviour_logprobs, advantages, action_mask, *, num_tokens, agg, num_sequences, **knobs)
    -> (loss, metrics)``, all ``[b, s]``."""
    logs: tuple[str, ...]
    """Its own metric keys, besides ``actor/pg_loss`` and the ratio/KL/ESS statistics every loss reports
    (``actor/clip_frac_dual`` only with a dual clip)."""


ESTIMATORS: dict[str, Estimator] = {e.section: e for e in (
    Estimator(section="gae", per_token=True, fn=adv_lib.gae),
    Estimator(section="group", per_token=False, fn=adv_lib.grpo_advantages),
    Estimator(section="running_mean", per_token=False, fn=adv_lib.running_mean_advantages),
)}

POLICY_LOSSES: dict[str, PolicyLoss] = {p.section: p for p in (
    PolicyLoss(section="dis", fn=loss_lib.dis_policy_loss,
               logs=("actor/dis_masked_low_frac", "actor/dis_masked_high_frac")),
    PolicyLoss(section="ppo_clip", fn=loss_lib.ppo_clip_policy_loss, logs=("actor/clip_frac", "actor/clip_frac_dual")),
)}


@dataclass(frozen=True, slots=True)
class Objective:
    """What one objective needs and computes."""

    name: str
    """``algorithm.name``."""
    advantages: Estimator
    """Its advantage estimator."""
    loss: PolicyLoss
    """Its policy loss."""
    ratio_against: Literal["rollout_logprobs", "old_logprobs"]
    """The micro-batch key of the ratio's behaviour log-probs: the engine's saved ones, or the policy's before
    this batch's first optimizer step (recomputed; PPO-style mini-batch epochs make that clip bite)."""
    grouped: bool
    """Samples come in groups of ``algorithm.group_size`` rollouts of one prompt."""
    summary: str
    """One line for help texts."""

    @property
    def critic(self) -> bool:
        """Needs a value model: its estimator reads a critic's values."""
        return self.advantages.per_token

    @property
    def needs_old_logprobs(self) -> bool:
        """The policy's log-probs must be recomputed before the first optimizer step on a batch."""
        return self.ratio_against == "old_logprobs"

    @property
    def sections(self) -> tuple[str, str]:
        """The ``algorithm.<section>``s it reads: its estimator's and its loss's."""
        return self.advantages.section, self.loss.section


def _row(name: str, advantages: str, loss: str, ratio_against: str, summary: str) -> Objective:
    return Objective(name=name, advantages=ESTIMATORS[advantages], loss=POLICY_LOSSES[loss],
                     ratio_against=ratio_against, grouped=advantages == "group", summary=summary)


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    _row("sao", "gae", "dis", "rollout_logprobs",
         "SAO: single rollout, critic + token-level GAE, DIS against rollout log-probs"),
    _row("ppo", "gae", "ppo_clip", "rollout_logprobs", "PPO: critic + GAE, clip against rollout log-probs"),
    _row("grpo", "group", "ppo_clip", "old_logprobs",
         "GRPO: group-normalised outcome, PPO clip against the old policy"),
    _row("grpo_dis", "group", "dis", "rollout_logprobs",
         "GRPO + DIS: group-normalised outcome, DIS against rollout log-probs"),
    _row("sao_running_mean", "running_mean", "dis", "rollout_logprobs",
         "SAO with a running-mean baseline instead of the critic"),
)}


def objective(name: str) -> Objective:
    """The row of ``name``; ValueError listing the known objectives otherwise."""
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown algorithm.name {name!r}; choose one of {sorted(OBJECTIVES)}") from None


def users_of(section: str) -> list[str]:
    """The objectives that read ``algorithm.<section>`` (for error messages)."""
    return [o.name for o in OBJECTIVES.values() if section in o.sections]
