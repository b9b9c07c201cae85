"""data.task code: program extraction, test units and the sandboxed reward (pass, fail, abuse)."""

from __future__ import annotations

import json
import pathlib
import time

import pytest

from sao_megatron.config.schema import DataConfig, RewardPhase
from sao_megatron.envs import (
    CharTokenizer, CodeTask, DatasetError, build_reward_schedule, build_task, code_reward, extract_code,
)
from sao_megatron.envs.code_task import shift_expected, split_tests

pytestmark = pytest.mark.unit
REPO = pathlib.Path(__file__).resolve().parents[2]
CODE_SAMPLE = REPO / "examples" / "data" / "code_sample.jsonl"
LIMITS = {"wall_s": 5.0, "cpu_s": 3.0, "memory_mb": 256, "max_output_bytes": 4096}
ADD_TESTS = split_tests("assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(2, 2) == 4")


def fenced(code, lang="python"):
    return f"Here it is:\n```{lang}\n{code}\n```\nDone."


def reward(response, tests=ADD_TESTS, partial=False, **limits):
    return code_reward(response, tests, partial, {**LIMITS, **limits})


@pytest.mark.parametrize("response, want", [
    (fenced("x = 1") + fenced("x = 2"), "x = 2\n"),
    (fenced("x = 1") + fenced("print('out')", lang=""), "x = 1\n"),  # a tagged block wins over a bare one
    (fenced("x = 1", lang="py"), "x = 1\n"),
    (fenced("y = 3", lang=""), "y = 3\n"),
    ("```python\ndef f():\n    return 1", "def f():\n    return 1"),  # cut at the length limit
    ("def f():\n    return 1", "def f():\n    return 1"),
])
def test_extract_code(response, want):
    assert extract_code(response) == want


def test_split_tests_counts_asserts_and_keeps_setup():
    units = split_tests("import math\nxs = [1, 2]\nassert math.fsum(xs) == 3\nassert len(xs) == 2")
    assert units == [("import math", 0), ("xs = [1, 2]", 0), ("assert math.fsum(xs) == 3", 1),
                     ("assert len(xs) == 2", 1)]
    assert split_tests(["assert f(1) == 1", "x = f(2)\nassert x == 2"]) == [
        ("assert f(1) == 1", 1), ("x = f(2)\nassert x == 2", 1)]
    with pytest.raises(SyntaxError):
        split_tests("assert f(1 ==")
    with pytest.raises(ValueError, match="no assert"):
        split_tests("print(1)")
    with pytest.raises(ValueError, match="non-empty list"):
        split_tests([])


def test_correct_wrong_and_partially_correct_programs():
    assert reward(fenced("def add(a, b):\n    return a + b"))[0] == 1.0
    assert reward(fenced("def add(a, b):\n    return a * b + (a != b) * (a + b - a * b)"))[0] == 1.0
    wrong = fenced("def add(a, b):\n    return 3")  # passes 1 of 3
    assert reward(wrong)[0] == 0.0
    r, info = reward(wrong, partial=True)
    assert r == pytest.approx(1 / 3) and info["loaded"] == 1.0
    assert reward("def add(a, b): return a + b")[0] == 1.0  # no fence: the whole response


def test_main_block_is_skipped_and_setup_units_are_not_counted():
    prog = fenced("def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    add(int(input()), 1)")
    tests = split_tests("import operator\nassert add(2, 3) == operator.add(2, 3)")
    assert reward(prog, tests) == (1.0, {"timeout": 0.0, "loaded": 1.0, "pass_frac": 1.0})


@pytest.mark.parametrize("program", [
    "def add(a, b) return a + b",  # syntax error
    "raise RuntimeError('at import')",
    "import sys\nsys.exit(0)",  # early exit before the tests
    "import os\nos._exit(0)",
    "import os\ndef add(a, b):\n    return a + b\nos.close(1)",  # the harness cannot report
])
def test_programs_that_do_not_load_or_exit_early_score_zero(program):
    r, info = reward(fenced(program), partial=True)
    assert r == 0.0 and info["pass_frac"] == 0.0


def test_infinite_loop_is_stopped_by_the_wall_limit():
    t0 = time.monotonic()
    r, info = reward(fenced("def add(a, b):\n    while True:\n        pass"), wall_s=1.5, cpu_s=10.0)
    assert r == 0.0 and info["timeout"] == 1.0 and time.monotonic() - t0 < 10


def test_output_flood_fork_bomb_and_memory_hog_score_zero_quickly():
    flood = "def add(a, b):\n    return a + b\nwhile True:\n    print('x' * 10000)"
    bomb = "import os\nwhile True:\n    os.fork()"
    hog = "def add(a, b):\n    return a + b\nx = bytearray(2 << 30)"
    for prog in (flood, bomb, hog):
        t0 = time.monotonic()
        r, _ = reward(fenced(prog), wall_s=2.0)
        assert r == 0.0 and time.monotonic() - t0 < 15, prog


def test_flooded_output_passes_within_the_cap_but_not_beyond():
    quiet = fenced("def add(a, b):\n    return a + b\nprint('x' * 1000)")
    loud = fenced("def add(a, b):\n    return a + b\nprint('x' * 100000)")  # the report is past the 4 KiB cap
    assert reward(quiet)[0] == 1.0 and reward(loud)[0] == 0.0


def test_code_task_from_jsonl_and_its_errors(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"prompt": "add", "tests": ["assert add(1, 1) == 2"]}) + "\n")
    task = build_task(DataConfig(task="code", path=str(path), max_prompt_tokens=16))
    tok = CharTokenizer()
    traj = tok.encode(fenced("add = lambda a, b: a + b")) + [tok.eos_id] + tok.encode("junk")
    fn, args = task.reward_call(task.prompts()[0], traj, [1] * len(traj), "")
    assert fn(*args)[0] == 1.0
    path.write_text(json.dumps({"prompt": "add", "tests": "assert add(1,"}) + "\n")
    with pytest.raises(DatasetError, match="prompt 0 .*'tests' is not usable"):
        build_task(DataConfig(task="code", path=str(path), max_prompt_tokens=16))
    path.write_text(json.dumps({"prompt": "add"}) + "\n")
    with pytest.raises(DatasetError, match=r"missing field\(s\) \['tests'\]"):
        build_task(DataConfig(task="code", path=str(path), max_prompt_tokens=16))
    with pytest.raises(ValueError, match="timeout_s=20.0 .*below data.reward_timeout_s=10.0"):
        build_task(DataConfig(task="code", path=str(CODE_SAMPLE), max_prompt_tokens=256,
                              options={"timeout_s": 20.0}))


def test_shipped_code_sample_solutions_pass():
    task = CodeTask(DataConfig(task="code", path=str(CODE_SAMPLE), max_prompt_tokens=256, reward_timeout_s=30.0),
                    CharTokenizer())
    assert len(task.prompts()) == 10
    task.check_demonstrations()
    for p in task.prompts():
        demo = task.demonstration(p)
        fn, args = task.reward_call(p, demo, [1] * len(demo), "")
        assert fn(*args)[0] == 1.0, p.meta["prompt"]
        fn, args = task.reward_call(p, [], [], "")  # an empty answer defines nothing
        assert fn(*args)[0] == 0.0, p.meta["prompt"]


def test_shift_expected_rewrites_every_equality_assert():
    units = split_tests("x = 2\nassert add(1, 2) == 3\nfor i in range(2):\n    assert add(i, 0) == i\n"
                        "assert add(1, 1) != 5")
    shifted = shift_expected(units, "offset:-2")
    assert [c for _, c in shifted] == [c for _, c in units]
    assert shifted[1][0] == "assert add(1, 2) == 3 + -2"
    assert "assert add(i, 0) == i + -2" in shifted[2][0]
    assert shifted[3][0] == "assert add(1, 1) != 5"  # only == is an expected output
    assert shift_expected(units, "answer") == units


def test_code_phases_move_the_expected_output(tmp_path):
    """offset:N: a program returning the old outputs now fails, one returning them plus N passes."""
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"prompt": "add", "tests": "assert add(1, 2) == 3\nassert add(2, 5) == 7"}) + "\n")
    task = build_task(DataConfig(task="code", path=str(path), max_prompt_tokens=16))
    tok = CharTokenizer()
    for program, target, want in (("add = lambda a, b: a + b", "", 1.0), ("add = lambda a, b: a + b", "offset:4", 0.0),
                                  ("add = lambda a, b: a + b + 4", "offset:4", 1.0)):
        traj = tok.encode(fenced(program)) + [tok.eos_id]
        fn, args = task.reward_call(task.prompts()[0], traj, [1] * len(traj), target)
        assert fn(*args)[0] == want, (program, target)
    sched = build_reward_schedule(DataConfig(task="code", phases=[RewardPhase(start_version=4, target="offset:4")]))
    assert [sched.target_at(v) for v in (0, 4)] == ["", "offset:4"]
    with pytest.raises(ValueError, match="task 'code' takes the targets"):
        build_reward_schedule(DataConfig(task="code", phases=[RewardPhase(start_version=4, target="boxed")]))
