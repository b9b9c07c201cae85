"""Tasks, environments and rewards (no torch: imported by reward worker processes).

``build_task(data_cfg)`` gives the task named by ``DataConfig.task``:

- ``arithmetic``: single-turn verifiable arithmetic (exact match + optional shaping).
- ``calculator``: multi-turn tool use with a sandboxed Python-expression calculator.
"""

from __future__ import annotations

from sao_megatron.config.schema import DataConfig
from sao_megatron.envs.arithmetic import ArithmeticTask, arithmetic_reward, check_target
from sao_megatron.envs.base import Env, Prompt, SingleTurnEnv, StepResult, Task
from sao_megatron.envs.dataset import DatasetError, load_jsonl
from sao_megatron.envs.rewards import RewardOutcome, RewardPool, RewardSchedule
from sao_megatron.envs.sandbox import SandboxLimits, SandboxResult, run_python
from sao_megatron.envs.tokenizer import CharTokenizer
from sao_megatron.envs.tools import CalculatorEnv, CalculatorTask, calculator

TASKS: dict[str, type[ArithmeticTask]] = {"arithmetic": ArithmeticTask, "calculator": CalculatorTask}


def build_task(data: DataConfig, tokenizer: CharTokenizer | None = None) -> Task:
    """The task named by ``data.task``, with prompts from ``data.path`` (JSONL) or its generator."""
    if data.task not in TASKS:
        raise ValueError(f"data.task={data.task!r} is unknown; choose one of {sorted(TASKS)}")
    cls = TASKS[data.task]
    tokenizer = tokenizer or CharTokenizer()
    prompts = None
    if data.path is not None:
        prompts = load_jsonl(data.path, tokenizer, max_prompt_tokens=data.max_prompt_tokens, required=("answer",))
    task = cls(num_prompts=data.num_prompts, seed=data.seed, options=data.options, prompts=prompts,
               tokenizer=tokenizer)
    longest = max(len(p.input_ids) for p in task.prompts())
    if longest > data.max_prompt_tokens:
        raise ValueError(f"data.max_prompt_tokens={data.max_prompt_tokens} is below the longest generated "
                         f"prompt ({longest} tokens); raise it or lower data.options operand sizes")
    return task


def build_reward_schedule(data: DataConfig) -> RewardSchedule:
    """Phases of ``data.phases`` checked against the arithmetic targets."""
    return RewardSchedule(data.phases, check=check_target)


__all__ = [
    "ArithmeticTask", "CalculatorEnv", "CalculatorTask", "CharTokenizer", "DatasetError", "Env", "Prompt",
    "RewardOutcome", "RewardPool", "RewardSchedule", "SandboxLimits", "SandboxResult", "SingleTurnEnv",
    "StepResult", "TASKS", "Task", "arithmetic_reward", "build_reward_schedule", "build_task", "calculator",
    "load_jsonl", "run_python",
]
