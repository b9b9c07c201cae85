"""Environment and task interfaces shared by every task family.

A *task* owns a prompt set, a tokenizer and an outcome reward; for each episode it makes an
*environment* that turns the policy's generated tokens into observation tokens (tool output,
chat glue) until the episode is done. The scheduler drives episodes:

    ids = env.reset(prompt)                        # prompt tokens (the model's context)
    loop: action = generate(ids + trajectory)      # action tokens, action_mask 1
          step = env.step(action)                  # observation tokens, action_mask 0
    outcome = task.reward_call(...) in a worker     # scalar outcome reward

``Env.step`` runs on a worker thread (it may wait on a sandboxed subprocess); the outcome reward
runs in a process pool (``envs.rewards.RewardPool``), so the reward function must be a picklable
module-level callable.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sao_megatron.envs.tokenizer import CharTokenizer


@dataclass(slots=True)
class Prompt:
    """One dataset entry."""

    index: int
    """Position in the dataset (the unit of exactly-once accounting)."""
    input_ids: list[int]
    """Prompt tokens, bos included."""
    meta: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable task data (text, answer, ...), passed to the reward function."""


@dataclass(slots=True)
class StepResult:
    """What the environment returns after one generated turn."""

    observation_ids: list[int]
    """Tokens the environment appends (action_mask 0); empty when done."""
    done: bool
    """The episode is over; the outcome reward follows."""
    reward: float = 0.0
    """Per-turn reward, placed on this turn's last action token."""
    info: dict[str, Any] = field(default_factory=dict)
    """Diagnostics (e.g. the tool's error)."""


class Env(abc.ABC):
    """One episode's environment (not shared between episodes)."""

    @abc.abstractmethod
    def reset(self, prompt: Prompt) -> list[int]:
        """Start the episode; return the prompt tokens the policy conditions on."""

    @abc.abstractmethod
    def step(self, action_ids: list[int], *, finish_reason: str) -> StepResult:
        """Consume one generated turn (``finish_reason`` 'stop' or 'length'); return what follows."""


class SingleTurnEnv(Env):
    """The whole trajectory is one generation; done after the first step."""

    def reset(self, prompt: Prompt) -> list[int]:
        return list(prompt.input_ids)

    def step(self, action_ids: list[int], *, finish_reason: str) -> StepResult:
        return StepResult(observation_ids=[], done=True)


RewardFn = Callable[..., "float | tuple[float, dict[str, float]]"]


class Task(abc.ABC):
    """A family of episodes: prompts, environments, the outcome reward and demonstrations."""

    name: str = "task"

    def __init__(self, tokenizer: CharTokenizer | None = None) -> None:
        self.tokenizer = tokenizer or CharTokenizer()

    @property
    def stop_token_ids(self) -> list[int]:
        """Tokens that end a generated turn."""
        return [self.tokenizer.eos_id]

    @abc.abstractmethod
    def prompts(self) -> list[Prompt]:
        """The dataset (indices 0..N-1, in order)."""

    def heldout_prompts(self, num: int) -> list[Prompt]:
        """Up to ``num`` evaluation prompts disjoint from ``prompts()`` (deterministic; ``envs.split``).

        ValueError (with the fix) when the task has none."""
        raise ValueError(f"task {self.name!r} has no held-out evaluation split")

    def make_env(self) -> Env:
        return SingleTurnEnv()

    @abc.abstractmethod
    def reward_call(self, prompt: Prompt, trajectory_ids: list[int], action_mask: list[int],
                    target: str) -> tuple[RewardFn, tuple]:
        """(picklable function, args) computing the outcome reward under phase ``target``."""

    @abc.abstractmethod
    def demonstration(self, prompt: Prompt) -> list[int]:
        """A correct trajectory (tokens after the prompt) for supervised warm-up."""

    def check_demonstrations(self) -> None:
        """Raise ValueError (saying how to fix it) when ``demonstration`` cannot serve a warm-up."""

    def demonstration_mask(self, prompt: Prompt) -> list[int]:
        """Action mask of ``demonstration``: 1 where the policy would generate the token."""
        return [1] * len(self.demonstration(prompt))

    def decode_actions(self, trajectory_ids: list[int], action_mask: list[int]) -> str:
        """Text of the policy's own tokens (specials dropped, up to the first eos)."""
        ids = [t for t, m in zip(trajectory_ids, action_mask) if m]
        if self.tokenizer.eos_id in ids:
            ids = ids[:ids.index(self.tokenizer.eos_id)]
        return self.tokenizer.decode(ids, skip_special=True, strict=False)
