"""Tasks, environments and rewards (no torch: imported by reward worker processes).

``build_task(data_cfg)`` gives the task named by ``DataConfig.task``:

- ``arithmetic``: single-turn verifiable arithmetic (exact match + optional shaping).
- ``calculator``: multi-turn tool use with a sandboxed Python-expression calculator.
- ``math``: JSONL problems with a gold answer, reward 1/0 by math-verify (``envs.math_task``).
- ``tool_chain``: multi-step arithmetic through a one-operation calculator (the CPU study task).
- ``code``: JSONL programming problems with assert tests run in the sandbox (``envs.code_task``).

The tiny tasks use ``CharTokenizer``; ``math`` and ``code`` use the checkpoint's own Hugging Face
tokenizer (``HFTokenizer(model.hf_dir)``, chat template included) when ``model.hf_dir`` is set.
"""

from __future__ import annotations

from sao_megatron.config.schema import DataConfig, ModelConfig
from sao_megatron.envs.arithmetic import ArithmeticTask, arithmetic_reward, check_target
from sao_megatron.envs.base import Env, Prompt, SingleTurnEnv, StepResult, Task
from sao_megatron.envs.code_task import CodeTask, code_reward, extract_code
from sao_megatron.envs.dataset import DatasetError, load_jsonl
from sao_megatron.envs.hf_tokenizer import HFTokenizer, check_vocab
from sao_megatron.envs.math_task import MathTask, last_boxed, math_reward
from sao_megatron.envs.rewards import RewardOutcome, RewardPool, RewardSchedule
from sao_megatron.envs.sandbox import SandboxLimits, SandboxResult, run_python
from sao_megatron.envs.tokenizer import CharTokenizer
from sao_megatron.envs.text_task import TextTask
from sao_megatron.envs.tool_chain import ToolChainTask
from sao_megatron.envs.tools import CalculatorTask, ToolCallEnv, calculator

TASKS: dict[str, type[Task]] = {"arithmetic": ArithmeticTask, "calculator": CalculatorTask, "math": MathTask,
                                "code": CodeTask, "tool_chain": ToolChainTask}


def build_task(data: DataConfig, tokenizer: CharTokenizer | HFTokenizer | None = None, *,
               model: ModelConfig | None = None) -> Task:
    """The task named by ``data.task``, with prompts from ``data.path`` (JSONL) or its generator.

    With ``model``: ``math``/``code`` tokenize with ``model.hf_dir``'s tokenizer when it is set, and
    a tokenizer with more ids than ``model.vocab_size`` is a ValueError.
    """
    if data.task not in TASKS:
        raise ValueError(f"data.task={data.task!r} is unknown; choose one of {sorted(TASKS)}")
    cls = TASKS[data.task]
    if tokenizer is None:
        hf_dir = model.hf_dir if model is not None and issubclass(cls, TextTask) else None
        tokenizer = HFTokenizer(hf_dir) if hf_dir else CharTokenizer()
    if model is not None:
        check_vocab(tokenizer, model.vocab_size, f"model.hf_dir={model.hf_dir!r}" if isinstance(
            tokenizer, HFTokenizer) else f"task {data.task!r} (char tokenizer)")
    if issubclass(cls, TextTask):
        return cls(data, tokenizer)
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
    """Phases of ``data.phases`` checked against the task's targets."""
    cls = TASKS.get(data.task, ArithmeticTask)
    if issubclass(cls, TextTask):
        return RewardSchedule(data.phases, check=cls.check_target)
    return RewardSchedule(data.phases, check=check_target)


__all__ = [
    "ArithmeticTask", "CalculatorTask", "CharTokenizer", "CodeTask", "DatasetError", "Env",
    "HFTokenizer", "MathTask", "Prompt", "RewardOutcome", "RewardPool", "RewardSchedule", "SandboxLimits",
    "SandboxResult", "SingleTurnEnv", "StepResult", "TASKS", "Task", "TextTask", "ToolCallEnv", "ToolChainTask", "arithmetic_reward",
    "build_reward_schedule", "build_task", "calculator", "check_vocab", "code_reward", "extract_code",
    "last_boxed", "load_jsonl", "math_reward", "run_python",
]
