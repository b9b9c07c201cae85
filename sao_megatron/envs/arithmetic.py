"""Single-turn verifiable arithmetic: ``<bos>17+5=`` -> ``22<eos>``, exact-match reward.

Difficulty via ``DataConfig.options``: ``min_operand``/``max_operand`` (operand range),
``num_operands`` and ``ops`` (characters from ``+-*``). A tiny random model rarely hits the exact
answer, so a shaping term is on by default (``partial_credit``): ``format_reward`` for an answer
made only of digits (and a leading minus) that ends with eos, plus up to ``digit_reward`` for the
fraction of answer positions that match. Exact match always scores 1.0.

Non-stationary targets (``DataConfig.phases[].target``) change what counts as correct for the same
prompt: ``answer`` (default), ``reverse`` (the answer's digits written backwards) and ``offset:N``
(the answer plus N).

Held-out evaluation problems (``heldout_prompts``, see ``envs.split``): ``heldout_fraction`` (default
0) > 0 holds a fixed hash bucket of problems out of training; 0 draws evaluation problems with their
own seed and skips every training prompt (the training set is unchanged).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from sao_megatron.envs.base import Prompt, RewardFn, Task
from sao_megatron.envs.split import (check_fraction, draw_heldout, in_heldout_bucket, problem_key, require_heldout,
                                     split_by_bucket)
from sao_megatron.envs.tokenizer import CharTokenizer

_TARGET = re.compile(r"^(answer|reverse|offset:-?\d+)?$")


def parse_options(options: dict, defaults: dict, task: str) -> dict:
    """Merge ``options`` over ``defaults``; unknown keys or wrong types are a ValueError."""
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ValueError(f"data.options: unknown option(s) {unknown} for task {task!r}; "
                         f"known: {sorted(defaults)}")
    out = dict(defaults)
    for k, v in options.items():
        want = type(defaults[k])
        if want is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ValueError(f"data.options.{k}={v!r} must be a {want.__name__} (task {task!r})")
        out[k] = v
    return out


def check_target(target: str) -> None:
    if not _TARGET.match(target):
        raise ValueError(f"reward phase target {target!r} is not one of 'answer', 'reverse', 'offset:N'")


def expected_answer(answer: str, target: str) -> str:
    """The string that scores 1.0 under ``target``."""
    if target in ("", "answer"):
        return answer
    if target == "reverse":
        return answer[::-1]
    return str(int(answer) + int(target.split(":", 1)[1]))


def arithmetic_reward(response: str, ended: bool, answer: str, target: str, partial_credit: bool,
                      format_reward: float, digit_reward: float) -> tuple[float, dict[str, float]]:
    """Outcome reward; runs in a reward worker. ``ended``: the response was closed by eos."""
    want = expected_answer(answer, target)
    exact = float(ended and response == want)
    if exact or not partial_credit:
        return exact, {"exact": exact}
    well_formed = ended and re.fullmatch(r"-?\d+", response) is not None
    matches = sum(a == b for a, b in zip(response, want))
    frac = matches / max(len(response), len(want))
    shaped = format_reward * well_formed + digit_reward * frac
    return shaped, {"exact": 0.0, "format": float(well_formed), "digit_frac": frac}


@dataclass(slots=True)
class _Problem:
    text: str
    answer: str


class ArithmeticTask(Task):
    """Generated (or JSONL with ``prompt`` + ``answer``) arithmetic problems."""

    name = "arithmetic"
    defaults = {"min_operand": 0, "max_operand": 9, "num_operands": 2, "ops": "+",
                "partial_credit": True, "format_reward": 0.1, "digit_reward": 0.4, "demo_answers": "correct",
                "heldout_fraction": 0.0}

    def __init__(self, *, num_prompts: int = 1024, seed: int = 0, options: dict | None = None,
                 prompts: list[Prompt] | None = None, tokenizer: CharTokenizer | None = None) -> None:
        super().__init__(tokenizer)
        self.opts = parse_options(options or {}, self.defaults, self.name)
        o = self.opts
        if not 0 <= o["min_operand"] <= o["max_operand"] or o["num_operands"] < 1:
            raise ValueError("data.options: need 0 <= min_operand <= max_operand and num_operands >= 1")
        if o["demo_answers"] not in ("correct", "random"):
            raise ValueError(f"data.options.demo_answers={o['demo_answers']!r} must be 'correct' or 'random'")
        if not o["ops"] or set(o["ops"]) - set("+-*"):
            raise ValueError(f"data.options.ops={o['ops']!r} must be a non-empty string of '+', '-', '*'")
        check_fraction(o["heldout_fraction"])
        self.seed = seed
        if prompts is not None:
            prompts = split_by_bucket(prompts, o["heldout_fraction"])[0] if o["heldout_fraction"] else prompts
        self._prompts = prompts if prompts is not None else self._generate(num_prompts, seed)

    def _generate(self, num_prompts: int, seed: int) -> list[Prompt]:
        rng, fraction = random.Random(seed), self.opts["heldout_fraction"]
        out = []
        for _ in range(num_prompts * 1000 + 1000):  # the bucket holds a fraction < 1: this ends long before
            if len(out) == num_prompts:
                return out
            p = self._to_prompt(len(out), self._problem(rng))
            if not fraction or not in_heldout_bucket(problem_key(p), fraction):
                out.append(p)
        raise ValueError(f"data.options.heldout_fraction={fraction} leaves (almost) no training problem in this "
                         "problem space; lower it or widen the operand range")

    def _to_prompt(self, index: int, p: _Problem) -> Prompt:
        return Prompt(index=index, input_ids=[self.tokenizer.bos_id] + self.tokenizer.encode(p.text),
                      meta={"prompt": p.text, "answer": p.answer})

    def heldout_prompts(self, num: int) -> list[Prompt]:
        """Up to ``num`` distinct evaluation problems, none of them a training prompt (deterministic)."""
        rng = random.Random(f"heldout:{self.seed}")
        train_keys = {problem_key(p) for p in self._prompts}
        found = draw_heldout(lambda i: self._to_prompt(i, self._problem(rng)), num, train_keys=train_keys,
                             fraction=self.opts["heldout_fraction"])
        return require_heldout(found, num, self.name, "the training set covers the whole problem space: set "
                               "data.options.heldout_fraction (e.g. 0.2) or widen the operand range")

    def _problem(self, rng: random.Random) -> _Problem:
        o = self.opts
        nums = [rng.randint(o["min_operand"], o["max_operand"]) for _ in range(o["num_operands"])]
        expr = str(nums[0]) + "".join(rng.choice(o["ops"]) + str(n) for n in nums[1:])
        # Only digits and + - * were generated: eval is exact integer arithmetic here.
        return _Problem(text=expr + "=", answer=str(eval(expr, {"__builtins__": {}})))  # noqa: S307

    def prompts(self) -> list[Prompt]:
        return self._prompts

    def reward_call(self, prompt: Prompt, trajectory_ids: list[int], action_mask: list[int],
                    target: str) -> tuple[RewardFn, tuple]:
        ended = self.tokenizer.eos_id in trajectory_ids
        o = self.opts
        args = (self.decode_actions(trajectory_ids, action_mask), ended, str(prompt.meta["answer"]), target,
                o["partial_credit"], o["format_reward"], o["digit_reward"])
        return arithmetic_reward, args

    def demonstration(self, prompt: Prompt) -> list[int]:
        """``demo_answers: random`` gives well-formed but wrong-on-purpose answers (a random result
        from the task's answer range): a warm-up on them teaches only the answer *format*, so any
        gain in exact-match reward afterwards is learnt by RL, not copied from demonstrations."""
        answer = str(prompt.meta["answer"])
        if self.opts["demo_answers"] == "random":
            o = self.opts
            rng = random.Random(f"{prompt.index}:{answer}")
            answer = str(rng.randint(o["min_operand"] * o["num_operands"], o["max_operand"] * o["num_operands"]))
        return self.tokenizer.encode(answer) + [self.tokenizer.eos_id]
