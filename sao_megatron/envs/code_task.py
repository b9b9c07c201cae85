"""``data.task: code``: write a Python program; reward from running the dataset's tests in the sandbox.

Dataset line: ``{"prompt": "Write add(a, b) ...", "tests": "assert add(1, 2) == 3\\n..."}`` where
``tests`` is Python source or a list of such strings (or ``"messages"`` instead of ``"prompt"``;
optional ``"solution"`` for the supervised warm-up). The program is the response's last
```` ```python ```` fenced block (```` ```py ```` or a bare ```` ``` ```` fence also count; an unclosed
final fence runs to the end of the response); without a fence, the whole response.

Reward (``code_reward``, in a RewardPool worker): the program and then the tests run in
``envs.sandbox`` (no network, CPU/memory/wall limits from ``data.options``, output truncated,
process count limited). ``data.options.sandbox``: ``isolated`` (default) runs them only in an
isolating mode (root namespaces, or an unprivileged user namespace) and stops at start-up where
neither works; ``unsafe`` then accepts the audit-hook fallback, which native code escapes. The
mode chosen is logged once at start-up. Test units: each list element, or each top-level statement of a test
string, where the ``assert`` statements are what is counted (the others are setup). Reward 1.0 if
the program loads and every unit passes, else 0.0; ``partial_credit: true`` gives the fraction of
units passing instead. A harness prints a per-call random token after the tests, so a program
that exits early (``sys.exit(0)``, ``os._exit(0)``) scores 0. Deliberate introspection of the
harness is not defended against beyond the sandbox's own limits.

Non-stationary phases (``data.phases`` targets): ``answer`` (the dataset's tests) and ``offset:N``:
every ``assert X == Y`` of the tests (at any depth) checks ``X == Y + N`` instead, so the expected
outputs move and the program has to follow (tests whose expected values are not numbers then fail).
"""

from __future__ import annotations

import ast
import json
import logging
import re
import secrets
from typing import Any

from sao_megatron.envs.base import Prompt, RewardFn
from sao_megatron.envs.dataset import DatasetError
from sao_megatron.envs.sandbox import SandboxLimits, run_python, sandbox_mode
from sao_megatron.envs.text_task import TextTask

logger = logging.getLogger(__name__)
_TARGET = re.compile(r"(|answer|offset:[+-]?\d+)")
_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)

# Reads everything it needs before the untrusted program runs (the program may rewrite its files);
# the program is exec'd as module "solution", so its `if __name__ == "__main__":` block is skipped.
_HARNESS = r'''
import json, os, sys
token = sys.stdin.readline().strip()
src = open("solution.py", encoding="utf-8").read()
units = json.load(open("cases.json", encoding="utf-8"))
g = {"__name__": "solution"}
try:
    exec(compile(src, "solution.py", "exec"), g)
    loaded = 1
except BaseException:
    loaded = 0
passed = counted = 0
for k, (code, counts) in enumerate(units):
    counted += counts
    if not loaded:
        continue
    try:
        exec(compile(code, f"test_{k}", "exec"), g)
        passed += counts
    except BaseException:
        pass
os.write(1, f"\n{token} {loaded} {passed} {counted}\n".encode())
'''


def extract_code(response: str) -> str:
    """The last fenced Python block of ``response`` (a ```python block wins over a bare one);
    the whole response when it has no fence."""
    blocks = [(bool(m.group(1)), m.group(2)) for m in _FENCE.finditer(response)]
    if not blocks:
        return response
    tagged = [code for is_py, code in blocks if is_py]
    return (tagged or [code for _, code in blocks])[-1]


def split_tests(tests: str | list[str]) -> list[tuple[str, int]]:
    """(source, counted) units: one per list element (counted 1), or per top-level statement of a
    test string (``assert`` counted 1, setup 0). ValueError for tests that do not parse."""
    if isinstance(tests, list):
        if not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError("'tests' must be Python source or a non-empty list of Python source strings")
        for t in tests:
            ast.parse(t)
        return [(t, 1) for t in tests]
    if not isinstance(tests, str):
        raise ValueError("'tests' must be Python source or a non-empty list of Python source strings")
    tree = ast.parse(tests)
    units = [(ast.get_source_segment(tests, s) or ast.unparse(s), int(isinstance(s, ast.Assert))) for s in tree.body]
    if not any(c for _, c in units):
        raise ValueError("'tests' has no assert statement; write the checks as asserts")
    return units


def shift_expected(units: list[tuple[str, int]], target: str) -> list[tuple[str, int]]:
    """Test units under phase ``target``: with ``offset:N`` every ``assert X == Y`` becomes
    ``assert X == (Y) + N``; other targets return the units unchanged."""
    if not target.startswith("offset:"):
        return units
    offset = int(target.split(":", 1)[1])
    out = []
    for source, counted in units:
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare)
                    and len(node.test.ops) == 1 and isinstance(node.test.ops[0], ast.Eq)):
                node.test.comparators[0] = ast.BinOp(node.test.comparators[0], ast.Add(), ast.Constant(offset))
        out.append((ast.unparse(ast.fix_missing_locations(tree)), counted))
    return out


def code_reward(response: str, units: list[tuple[str, int]], partial_credit: bool,
                limits: dict[str, float], isolation: str = "auto") -> tuple[float, dict[str, float]]:
    """Run the response's program and the test units in the sandbox (``isolation``: a mode of
    ``envs.sandbox.run_python``, as resolved by ``CodeTask`` at start-up); see the module docstring."""
    token = secrets.token_hex(16)
    res = run_python(_HARNESS, stdin=token + "\n", limits=SandboxLimits(**limits), isolation=isolation,
                     files={"solution.py": extract_code(response), "cases.json": json.dumps(units)})
    info = {"timeout": float(res.timed_out), "loaded": 0.0, "pass_frac": 0.0}
    report = next((line.split() for line in reversed(res.stdout.splitlines()) if line.startswith(token)), None)
    if res.timed_out or res.returncode != 0 or report is None:
        return 0.0, info
    loaded, passed, counted = (int(x) for x in report[1:4])
    frac = passed / counted if counted else 0.0
    info |= {"loaded": float(loaded), "pass_frac": frac}
    reward = frac if partial_credit else float(loaded == 1 and passed == counted)
    return reward, info


class CodeTask(TextTask):
    """Python programming problems with assert-based tests (``data.path`` JSONL)."""

    name = "code"
    required = ("tests",)
    example = '{"prompt": "Write a Python function add(a, b).", "tests": "assert add(1, 2) == 3"}'
    defaults: dict[str, Any] = {**TextTask.defaults, "partial_credit": False, "timeout_s": 5.0,
                                "cpu_s": 5.0, "memory_mb": 1024, "max_output_bytes": 65536, "sandbox": "isolated"}
    targets = "'answer', 'offset:N'"

    @classmethod
    def check_target(cls, target: str) -> None:
        if not _TARGET.fullmatch(target):
            raise ValueError(f"data.phases: task 'code' takes the targets {cls.targets} (got {target!r})")

    def __init__(self, data, tokenizer) -> None:
        super().__init__(data, tokenizer)
        o = self.opts
        if not 0 < o["timeout_s"] < data.reward_timeout_s:
            raise ValueError(f"data.options.timeout_s={o['timeout_s']} (the sandbox's wall limit) must be > 0 and "
                             f"below data.reward_timeout_s={data.reward_timeout_s}, so the sandbox stops a slow "
                             "program before the reward pool gives up on the worker")
        if o["cpu_s"] < 1 or o["memory_mb"] < 64 or o["max_output_bytes"] < 1024:
            raise ValueError("data.options: need cpu_s >= 1, memory_mb >= 64 and max_output_bytes >= 1024")
        self.isolation = sandbox_mode(o["sandbox"], what="code")
        for p in self._prompts:  # fail at start-up, not as a zero reward in every episode
            try:
                split_tests(p.meta["tests"])
            except (SyntaxError, ValueError) as exc:
                raise DatasetError(f"data.path={data.path!r}: prompt {p.index} (0-based, blank lines skipped): "
                                   f"'tests' is not usable ({exc})") from None

    def reward_call(self, prompt: Prompt, trajectory_ids: list[int], action_mask: list[int],
                    target: str) -> tuple[RewardFn, tuple]:
        o = self.opts
        limits = {"wall_s": o["timeout_s"], "cpu_s": o["cpu_s"], "memory_mb": o["memory_mb"],
                  "max_output_bytes": o["max_output_bytes"]}
        units = shift_expected(split_tests(prompt.meta["tests"]), target)
        return code_reward, (self.decode_actions(trajectory_ids, action_mask), units,
                             o["partial_credit"], limits, self.isolation)
