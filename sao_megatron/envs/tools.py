"""Multi-turn tool use: a calculator that evaluates Python expressions in the sandbox.

Episode (``<bos>347*29+18=`` prompt):

    action  <call>347*29+18</call>          generation stops at </call> (a stop token)
    obs     <obs>10081</obs>                 environment tokens, action_mask 0
    action  10081<eos>                       the final answer; exact match scores 1.0

If the engine trims the stop token, the environment inserts ``</call>`` itself as the first
observation token (glue, action_mask 0), so the context the policy sees is always well formed.
A tool call that evaluates without error earns ``tool_call_reward`` on that turn's last action
token (per-turn reward). The expression runs in ``envs.sandbox`` (no network, no files, CPU and
memory limits); errors come back as ``<obs>error: ...</obs>``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from sao_megatron.envs.arithmetic import ArithmeticTask
from sao_megatron.envs.base import Env, Prompt, RewardFn, StepResult
from sao_megatron.envs.sandbox import SandboxLimits, run_python, sandbox_mode
from sao_megatron.envs.tokenizer import CharTokenizer

_TOOL_CODE = """
expr = open("expr.txt").read()
print(eval(compile(expr, "<calculator>", "eval"), {"__builtins__": {}}, {}))
"""
_MAX_RESULT_CHARS = 24


def calculator(expr: str, *, limits: SandboxLimits | None = None, isolation: str = "auto") -> tuple[bool, str]:
    """Evaluate a Python expression in the sandbox -> (ok, text of the result or error).

    ``isolation``: a mode of ``envs.sandbox.run_python`` (``CalculatorTask`` resolves it at start-up
    from ``data.options.sandbox``)."""
    res = run_python(_TOOL_CODE, files={"expr.txt": expr}, isolation=isolation,
                     limits=limits or SandboxLimits(cpu_s=1, wall_s=3, memory_mb=256))
    if res.timed_out or res.returncode < 0:
        return False, "error: time limit"
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["error"])[-1]
        return False, "error: " + last.split(":", 1)[0][:_MAX_RESULT_CHARS]
    return True, res.stdout.strip()[:_MAX_RESULT_CHARS]


class ToolCallEnv(Env):
    """Alternates policy turns and tool observations until the policy answers without a call.

    ``tool(expr) -> (ok, text)`` evaluates the text between the turn's last ``<call>`` and
    ``</call>``; ``text`` is what the observation shows, and an ``ok`` call earns
    ``tool_call_reward`` on the turn's last action token. The calculator (sandboxed Python) and the
    tool chain's one-operation parser share this loop."""

    def __init__(self, tokenizer: CharTokenizer, tool: Callable[[str], tuple[bool, str]],
                 tool_call_reward: float) -> None:
        self.tok, self.tool, self.tool_call_reward = tokenizer, tool, tool_call_reward

    def reset(self, prompt: Prompt) -> list[int]:
        return list(prompt.input_ids)

    def step(self, action_ids: list[int], *, finish_reason: str) -> StepResult:
        tok = self.tok
        if tok.call_id not in action_ids or finish_reason == "length":
            return StepResult(observation_ids=[], done=True)
        start = len(action_ids) - 1 - action_ids[::-1].index(tok.call_id)
        closed = action_ids[-1] == tok.call_end_id
        expr = tok.decode([i for i in action_ids[start + 1:] if i != tok.call_end_id], skip_special=True,
                          strict=False)
        ok, text = self.tool(expr)
        obs = ([] if closed else [tok.call_end_id]) + [tok.obs_id] + tok.encode(text, strict=False) + [tok.obs_end_id]
        return StepResult(observation_ids=obs, done=False, reward=self.tool_call_reward if ok else 0.0,
                          info={"tool_ok": ok})


class CalculatorTask(ArithmeticTask):
    """Harder arithmetic that the policy can solve by calling the calculator tool."""

    name = "calculator"
    defaults = {**ArithmeticTask.defaults, "min_operand": 10, "max_operand": 999, "num_operands": 3,
                "ops": "+-*", "partial_credit": False, "tool_call_reward": 0.1, "sandbox": "isolated"}

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        # The model writes the calculator's expressions: the same sandbox policy as the code task.
        self.isolation = sandbox_mode(self.opts["sandbox"], what="calculator")

    @property
    def stop_token_ids(self) -> list[int]:
        return [self.tokenizer.eos_id, self.tokenizer.call_end_id]

    def make_env(self) -> Env:
        return ToolCallEnv(self.tokenizer, functools.partial(calculator, isolation=self.isolation),
                           self.opts["tool_call_reward"])

    def reward_call(self, prompt: Prompt, trajectory_ids: list[int], action_mask: list[int],
                    target: str) -> tuple[RewardFn, tuple]:
        # The answer is the last turn: the action tokens after the last observation token.
        last_obs = max((i for i, m in enumerate(action_mask) if m == 0), default=-1)
        return super().reward_call(prompt, trajectory_ids[last_obs + 1:], action_mask[last_obs + 1:], target)

    def demonstration(self, prompt: Prompt) -> list[int]:
        tok, expr, ans = self.tokenizer, prompt.meta["prompt"].rstrip("="), str(prompt.meta["answer"])
        return ([tok.call_id] + tok.encode(expr) + [tok.call_end_id, tok.obs_id] + tok.encode(ans)
                + [tok.obs_end_id] + tok.encode(ans) + [tok.eos_id])

    def demonstration_mask(self, prompt: Prompt) -> list[int]:
        expr, ans = prompt.meta["prompt"].rstrip("="), str(prompt.meta["answer"])
        return [1] * (len(expr) + 2) + [0] * (len(ans) + 2) + [1] * (len(ans) + 1)
