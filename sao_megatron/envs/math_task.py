"""``data.task: math``: prompts with a gold answer, outcome reward 1/0 by math-verify.

Dataset line: ``{"prompt": "What is 1/2 + 1/4?", "answer": "3/4"}`` (or ``"messages"`` instead of
``"prompt"``; optional ``"solution"`` for the supervised warm-up). The response's final answer is
the content of its last ``\\boxed{...}``; without one, math-verify searches the whole response
(last LaTeX or plain expression) unless ``data.options.require_boxed`` is true. Gold and final
answer are compared by ``math_verify.verify`` (equivalent forms count: ``1/2``, ``0.5``,
``\\frac{1}{2}``, ``50\\%``). The reward runs in a RewardPool worker; math-verify's own
(signal-based) time limit stops a pathological expression first, the pool's
``data.reward_timeout_s`` is the backstop.

Non-stationary phases (``data.phases`` targets, the paper's online setting): ``answer`` (the gold
answer), ``offset:N`` (the gold answer plus the integer N: the target moves and the policy has to
follow it; numeric gold answers only, integers, decimals or ``a/b``: another gold scores 0 with a
``reward_error``), ``boxed`` (the gold answer, counted only inside ``\boxed{}``: a format shift).
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from typing import Any

from sao_megatron.envs.base import Prompt, RewardFn
from sao_megatron.envs.dataset import DatasetError
from sao_megatron.envs.text_task import TextTask

_VERIFY_TIMEOUT_S = 3
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TARGET = re.compile(r"(|answer|boxed|offset:[+-]?\d+)")


def last_boxed(text: str) -> str | None:
    """Content of the last closed ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces balanced; None
    if there is none."""
    for m in reversed(list(_BOXED.finditer(text))):
        depth = 1
        for k in range(m.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[k], 0)
            if depth == 0:
                return text[m.end():k].strip()
    return None


def _parse(text: str) -> list:
    from math_verify import parse

    # math-verify's time limits use SIGALRM, which only the main thread may set; a reward worker
    # process calls us on its main thread, other callers rely on the RewardPool's time limit.
    limit = _VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    return parse(text, parsing_timeout=limit)


def parse_gold(answer: str) -> list:
    """math-verify's parse of a gold answer written bare (``3/4``), in ``$...$`` or in ``\\boxed{}``."""
    answer = answer.strip()
    if "$" in answer or "\\boxed" in answer:
        return _parse(answer)
    return _parse(f"${answer}$") or _parse(answer)


def math_reward(response: str, answer: str, require_boxed: bool) -> tuple[float, dict[str, float]]:
    """1.0 if the response's final answer equals ``answer`` (math-verify), else 0.0; runs in a reward worker."""
    from math_verify import verify

    boxed = last_boxed(response)
    if boxed is None and require_boxed:
        return 0.0, {"correct": 0.0, "boxed": 0.0, "parsed": 0.0}
    pred = _parse(f"$\\boxed{{{boxed}}}$") if boxed is not None else _parse(response)
    gold = parse_gold(answer)
    info = {"boxed": float(boxed is not None), "parsed": float(bool(pred)), "gold_parsed": float(bool(gold))}
    if not pred or not gold:
        return 0.0, {"correct": 0.0, **info}
    limit = _VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    correct = float(bool(verify(gold, pred, timeout_seconds=limit)))
    return correct, {"correct": correct, **info}


def shifted_answer(answer: str, target: str) -> str:
    """The gold answer under phase ``target``: ``offset:N`` adds N to a numeric gold (integer, decimal
    or ``a/b``, written back as an integer or ``a/b``); other targets keep it. ValueError for an
    offset of a non-numeric gold."""
    if not target.startswith("offset:"):
        return answer
    try:
        value = Fraction(answer.strip()) + int(target.split(":", 1)[1])
    except ValueError:
        raise ValueError(f"reward phase target {target!r} needs a numeric gold answer (an integer, decimal or "
                         f"a/b), got {answer!r}") from None
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


class MathTask(TextTask):
    """Math word problems with a gold answer (``data.path`` JSONL)."""

    name = "math"
    required = ("answer",)
    example = '{"prompt": "What is 1/2 + 1/4? Put the final answer in \\\\boxed{}.", "answer": "3/4"}'
    defaults: dict[str, Any] = {**TextTask.defaults, "require_boxed": False}
    targets = "'answer', 'offset:N', 'boxed'"

    @classmethod
    def check_target(cls, target: str) -> None:
        if not _TARGET.fullmatch(target):
            raise ValueError(f"data.phases: task 'math' takes the targets {cls.targets} (got {target!r})")

    def __init__(self, data, tokenizer) -> None:
        super().__init__(data, tokenizer)
        for p in self._prompts:
            ans = p.meta["answer"]
            if isinstance(ans, bool) or not isinstance(ans, (str, int, float)) or not str(ans).strip():
                raise DatasetError(f"data.path={data.path!r}: prompt {p.index} (0-based, blank lines skipped): "
                                   f"'answer' must be a non-empty string or number, got {ans!r}")

    def reward_call(self, prompt: Prompt, trajectory_ids: list[int], action_mask: list[int],
                    target: str) -> tuple[RewardFn, tuple]:
        args = (self.decode_actions(trajectory_ids, action_mask), shifted_answer(str(prompt.meta["answer"]), target),
                self.opts["require_boxed"] or target == "boxed")
        return math_reward, args
