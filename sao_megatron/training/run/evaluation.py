"""Held-out evaluation: pass@1 and mean reward with 95 % confidence intervals.

``evaluate_prompts`` runs one episode per held-out prompt on the engines (the same
``EpisodeRunner`` as training: multi-turn environments, stop tokens, budgets) and scores it with
the task's outcome reward under the phase target in force. A problem *passes* when its outcome
reward reaches 1.0 (exact answer, every test passing). ``PeriodicEval`` is what the trainer
calls between steps (rank 0, engines idle of weight updates); ``sao-megatron eval`` (``eval_cli``)
evaluates a checkpoint on its own engine.

Metrics (``eval/...``): ``pass_at_1`` with its Wilson interval ``ci_low``/``ci_high``,
``mean_reward`` with its Student-t interval ``reward_ci_low``/``reward_ci_high``, ``num_prompts``; and
``timing/eval_s`` (the trainer waits for it; training rollouts go on meanwhile).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

from sao_megatron.config.schema import DataConfig, EvalConfig, RolloutConfig
from sao_megatron.envs.base import Prompt, Task
from sao_megatron.envs.rewards import RewardPool, RewardSchedule
from sao_megatron.rollout.types import SamplingParams
from sao_megatron.algorithms.stats import t_interval, wilson_interval

log = logging.getLogger(__name__)
PASS_REWARD = 1.0 - 1e-9
# Request ids of evaluation episodes start far above the scheduler's (which count up from 0):
# an abort of one can never hit the other.
_UIDS = itertools.count(1 << 60)


@dataclass(slots=True)
class EvalResult:
    """Outcome rewards of the evaluated problems, in prompt order."""

    rewards: list[float] = field(default_factory=list)
    """Outcome reward per problem (0 when the reward failed)."""

    @property
    def passed(self) -> list[bool]:
        return [r >= PASS_REWARD for r in self.rewards]

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        n, k = len(self.rewards), sum(self.passed)
        low, high = wilson_interval(k, n)
        mean, r_low, r_high = t_interval(self.rewards)
        return {f"{prefix}/pass_at_1": k / n if n else float("nan"), f"{prefix}/ci_low": low,
                f"{prefix}/ci_high": high, f"{prefix}/mean_reward": mean, f"{prefix}/reward_ci_low": r_low,
                f"{prefix}/reward_ci_high": r_high, f"{prefix}/num_prompts": float(n)}


async def evaluate_prompts(client, task: Task, prompts: list[Prompt], sampling: SamplingParams, *,
                           max_turns: int, max_total_tokens: int, reward_pool: RewardPool, target: str = "",
                           concurrency: int = 64) -> EvalResult:
    """One episode per prompt on ``client``'s engines, scored by ``task``'s outcome reward."""
    from sao_megatron.scheduler.episode import Episode, EpisodeFailed, EpisodeRunner
    from sao_megatron.scheduler.prompts import PromptRef
    from sao_megatron.scheduler.stats import RolloutStats

    gate = asyncio.Event()
    gate.set()
    runner = EpisodeRunner(client, task, sampling, max_turns=max_turns, max_total_tokens=max_total_tokens,
                           partial_rollout="retract", gate=gate, stats=RolloutStats())
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int, prompt: Prompt) -> float:
        async with slots:
            ep = Episode(uid=next(_UIDS), ref=PromptRef(0, prompt.index), prompt=prompt, group_id=i)
            try:
                s = await runner.rollout(ep)
                fn, args = task.reward_call(prompt, s.response_ids, s.action_mask, target)
            except (EpisodeFailed, ValueError) as exc:  # counted as a failed problem, not a crash
                log.warning("evaluation episode for held-out prompt %d failed: %s", prompt.index, exc)
                return 0.0
            return (await reward_pool.score(fn, *args)).reward

    try:
        return EvalResult(list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))))
    finally:
        runner.close()


def eval_sampling(eval_cfg: EvalConfig, max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=eval_cfg.temperature)


def check_eval_config(eval_cfg: EvalConfig) -> None:
    """ValueError naming the bad ``eval.*`` field and the fix."""
    if eval_cfg.interval < 0 or eval_cfg.num_prompts < 1 or eval_cfg.temperature < 0:
        raise ValueError(f"eval: need interval >= 0 (0 disables), num_prompts >= 1 and temperature >= 0 (0 is "
                         f"greedy); got interval={eval_cfg.interval}, num_prompts={eval_cfg.num_prompts}, "
                         f"temperature={eval_cfg.temperature}")


class PeriodicEval:
    """Evaluates the engines' current weights every ``eval.interval`` steps (and after the last).

    Rank 0 only. ``rollout`` is the trainer's ``RolloutSide`` (its event-loop bridge, client and
    reward pool); the call blocks until the held-out problems are scored.
    """

    def __init__(self, eval_cfg: EvalConfig, task: Task, data: DataConfig, *, max_new_tokens: int,
                 num_steps: int, schedule: RewardSchedule | None = None) -> None:
        check_eval_config(eval_cfg)
        self.cfg, self.task, self.data, self.num_steps = eval_cfg, task, data, num_steps
        self.sampling = eval_sampling(eval_cfg, max_new_tokens)
        self.schedule = schedule or RewardSchedule([])
        # Fail at start-up, not at the first evaluation, when the task has no held-out split.
        self.prompts = task.heldout_prompts(eval_cfg.num_prompts) if eval_cfg.interval or eval_cfg.before_train else []

    @classmethod
    def from_config(cls, eval_cfg: EvalConfig, task: Task, data: DataConfig, rollout: RolloutConfig, *,
                    num_steps: int) -> PeriodicEval:
        """As the trainer builds it: the rollout's per-turn budget, the data section's phases."""
        from sao_megatron.envs import build_reward_schedule

        return cls(eval_cfg, task, data, max_new_tokens=rollout.max_new_tokens, num_steps=num_steps,
                   schedule=build_reward_schedule(data))

    def due(self, step: int) -> bool:
        """``step``: trainer steps done so far."""
        every = self.cfg.interval
        return bool(every) and step > 0 and (step % every == 0 or step == self.num_steps)

    def maybe_run(self, step: int, rollout, version: int) -> dict[str, float]:
        """The ``eval/*`` metrics when an evaluation is due at ``step``, else {}."""
        if not self.due(step):
            return {}
        return self.run(rollout, version, step=step)

    def before_training(self, rollout, version: int) -> dict[str, float]:
        """``eval_start/*``: the starting weights on the held-out problems when ``eval.before_train``, else {}."""
        if not self.cfg.before_train:
            return {}
        return self.run(rollout, version, step=0, prefix="eval_start")

    def run(self, rollout, version: int, *, step: int, prefix: str = "eval") -> dict[str, float]:
        coro = evaluate_prompts(rollout.client, self.task, self.prompts, self.sampling,
                                max_turns=self.data.max_turns, max_total_tokens=self.data.max_total_tokens,
                                reward_pool=rollout.scheduler.reward_pool, target=self.schedule.target_at(version))
        t0 = time.perf_counter()
        metrics = rollout.bridge.run(coro).metrics(prefix) | {f"timing/{prefix}_s": time.perf_counter() - t0}
        log.info("%s at step %d (version %d): pass@1 %.3f [%.3f, %.3f] over %d held-out problems, mean reward "
                 "%.3f", prefix, step, version, metrics[f"{prefix}/pass_at_1"], metrics[f"{prefix}/ci_low"],
                 metrics[f"{prefix}/ci_high"], len(self.prompts), metrics[f"{prefix}/mean_reward"])
        return metrics
