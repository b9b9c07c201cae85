"""``data.task: tool_chain``: multi-step arithmetic through a one-operation calculator tool.

The CPU task on which the paper's effects can show (issue 16): a large problem space (operands
``min_operand``..``max_operand``, ``num_operands`` of them, ops from ``ops``: 50**3 * 4 = 500,000
distinct problems with the defaults), trajectories of 10–40 tokens, and several turns with tool
observations between them, so skip-observation GAE differs from plain token GAE. Episode for
``<bos>12+34-5=``:

    action  <call>12+34</call>        the tool evaluates ONE binary operation
    obs     <obs>46</obs>              environment tokens, action_mask 0
    action  <call>46-5</call>          the next step uses the observed result
    obs     <obs>41</obs>
    action  41<eos>                    the answer turn: exact match scores 1.0 (partial credit optional)

The tool is a strict in-process parser (``int op int`` with op in ``+-*``), not a sandbox: nothing
is evaluated. A well-formed call earns ``tool_call_reward`` on that turn's last action token; a
malformed one returns ``<obs>error</obs>``. Prompts, held-out split, phases (``answer``,
``reverse``, ``offset:N``) and the outcome reward are those of ``arithmetic``, evaluated left to
right (no operator precedence: the tool chain computes left to right, and so does the answer).
``demo_answers: random`` (as in ``arithmetic``) makes the warm-up's final answers well-formed but
wrong on purpose (the tool calls stay correct): the warm-up then teaches the tool protocol only, and
answering with the last observation is left for RL to learn.
"""

from __future__ import annotations

import random
import re

from sao_megatron.envs.arithmetic import _Problem
from sao_megatron.envs.base import Env, Prompt
from sao_megatron.envs.tools import CalculatorTask, ToolCallEnv

_BINARY = re.compile(r"^(-?\d{1,6})([+\-*])(\d{1,6})$")


def binary_tool(expr: str) -> str | None:
    """The result of ``a op b`` as text, or None when ``expr`` is not exactly one such operation."""
    m = _BINARY.match(expr)
    if m is None:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def left_to_right(nums: list[int], ops: list[str]) -> list[int]:
    """Partial results of applying ``ops`` left to right: [n0 op0 n1, (..) op1 n2, ...]."""
    acc, out = nums[0], []
    for op, n in zip(ops, nums[1:]):
        acc = acc + n if op == "+" else acc - n if op == "-" else acc * n
        out.append(acc)
    return out


def _one_operation(expr: str) -> tuple[bool, str]:
    result = binary_tool(expr)
    return (False, "error") if result is None else (True, result)


class ToolChainTask(CalculatorTask):
    """Left-to-right arithmetic solved one tool call per operation (see the module docstring)."""

    name = "tool_chain"
    defaults = {**CalculatorTask.defaults, "min_operand": 0, "max_operand": 49, "num_operands": 3, "ops": "+-",
                "partial_credit": True, "tool_call_reward": 0.05}

    def _problem(self, rng: random.Random) -> _Problem:
        o = self.opts
        nums = [rng.randint(o["min_operand"], o["max_operand"]) for _ in range(o["num_operands"])]
        ops = [rng.choice(o["ops"]) for _ in nums[1:]]
        text = str(nums[0]) + "".join(op + str(n) for op, n in zip(ops, nums[1:])) + "="
        return _Problem(text=text, answer=str(left_to_right(nums, ops)[-1] if ops else nums[0]))

    def make_env(self) -> Env:
        return ToolCallEnv(self.tokenizer, _one_operation, self.opts["tool_call_reward"])

    def _steps(self, prompt: Prompt) -> list[tuple[str, str]]:
        """(call expression, result) per operation of the prompt's problem."""
        parts = re.findall(r"\d+|[+\-*]", prompt.meta["prompt"].rstrip("="))
        nums, ops = [int(x) for x in parts[0::2]], parts[1::2]
        partial = left_to_right(nums, ops)
        lhs = [nums[0], *partial[:-1]]
        return [(f"{a}{op}{n}", str(r)) for a, op, n, r in zip(lhs, ops, nums[1:], partial)]

    def _demo_answer(self, prompt: Prompt) -> str:
        answer = str(prompt.meta["answer"])
        if self.opts["demo_answers"] != "random":
            return answer
        o, rng = self.opts, random.Random(f"{prompt.index}:{answer}")
        span = o["max_operand"] * o["num_operands"]
        while (wrong := str(rng.randint(-span, span))) == answer:
            pass
        return wrong

    def demonstration(self, prompt: Prompt) -> list[int]:
        tok, out = self.tokenizer, []
        for expr, res in self._steps(prompt):
            out += [tok.call_id] + tok.encode(expr) + [tok.call_end_id, tok.obs_id] + tok.encode(res) + [tok.obs_end_id]
        return out + tok.encode(self._demo_answer(prompt)) + [tok.eos_id]

    def demonstration_mask(self, prompt: Prompt) -> list[int]:
        mask: list[int] = []
        for expr, res in self._steps(prompt):
            mask += [1] * (len(expr) + 2) + [0] * (len(res) + 2)
        return mask + [1] * (len(self._demo_answer(prompt)) + 1)
