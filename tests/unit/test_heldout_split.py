"""Held-out evaluation splits: deterministic, disjoint from training, training unchanged by default."""

from __future__ import annotations

import json
import random

import pytest

from sao_megatron.config.schema import DataConfig
from sao_megatron.envs import ArithmeticTask, build_task
from sao_megatron.envs.split import in_heldout_bucket

pytestmark = pytest.mark.unit


def _texts(prompts):
    return [p.meta["prompt"] for p in prompts]


def _old_generator(num: int, seed: int, lo: int, hi: int, n_ops: int, ops: str) -> list[str]:
    """The arithmetic generator as it was before held-out splits (reference for 'unchanged')."""
    rng, out = random.Random(seed), []
    for _ in range(num):
        nums = [rng.randint(lo, hi) for _ in range(n_ops)]
        out.append(str(nums[0]) + "".join(rng.choice(ops) + str(n) for n in nums[1:]) + "=")
    return out


@pytest.mark.parametrize("task,options", [("arithmetic", {"max_operand": 99}), ("calculator", {}),
                                          ("tool_chain", {}), ("tool_chain", {"heldout_fraction": 0.1})])
def test_heldout_never_in_training_and_deterministic(task, options):
    data = DataConfig(task=task, num_prompts=3000, max_prompt_tokens=32, seed=3, options=options)
    t = build_task(data)
    held = t.heldout_prompts(200)
    assert len(held) == 200 and len(set(_texts(held))) == 200
    assert not set(_texts(held)) & set(_texts(t.prompts()))
    assert _texts(build_task(data).heldout_prompts(200)) == _texts(held)
    assert [p.index for p in held] == list(range(200))


def test_default_training_set_is_unchanged():
    t = ArithmeticTask(num_prompts=500, seed=7, options={"max_operand": 99, "ops": "+-"})
    assert _texts(t.prompts()) == _old_generator(500, 7, 0, 99, 2, "+-")


def test_bucket_split_excludes_the_bucket_from_training():
    opts = {"min_operand": 0, "max_operand": 9, "heldout_fraction": 0.2}
    t = ArithmeticTask(num_prompts=2000, seed=0, options=opts)
    train = set(_texts(t.prompts()))
    held = set(_texts(t.heldout_prompts(100)))
    every = {f"{a}+{b}=" for a in range(10) for b in range(10)}
    # Slow reference: which of the 100 problems hash into the bucket.
    bucket = {x for x in every if in_heldout_bucket(x, 0.2)}
    assert 5 < len(bucket) < 40
    assert held == bucket and train == every - bucket
    assert [p.index for p in t.prompts()] == list(range(2000))


def test_exhausted_problem_space_says_how_to_fix():
    t = ArithmeticTask(num_prompts=500, seed=0, options={"max_operand": 4})  # all 25 problems trained on
    with pytest.raises(ValueError, match="heldout_fraction"):
        t.heldout_prompts(10)
    with pytest.raises(ValueError, match=r"heldout_fraction=1.0 must be in \[0, 1\)"):
        ArithmeticTask(num_prompts=5, options={"heldout_fraction": 1.0})


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_text_task_split_by_fraction_and_by_file(tmp_path):
    rows = [{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(200)]
    data = DataConfig(task="math", path=_write(tmp_path / "m.jsonl", rows), max_prompt_tokens=64,
                      options={"heldout_fraction": 0.25})
    t = build_task(data)
    train, held = _texts(t.prompts()), _texts(t.heldout_prompts(1000))
    assert sorted(train + held) == sorted(r["prompt"] for r in rows) and not set(train) & set(held)
    assert set(held) == {r["prompt"] for r in rows if in_heldout_bucket(r["prompt"], 0.25)}
    assert [p.index for p in t.prompts()] == list(range(len(train)))

    extra = [{"prompt": "What is 3+1?", "answer": "4"}, {"prompt": "What is 1000+1?", "answer": "1001"}]
    data = DataConfig(task="math", path=data.path, max_prompt_tokens=64,
                      options={"heldout_path": _write(tmp_path / "h.jsonl", extra)})
    t = build_task(data)
    assert _texts(t.heldout_prompts(10)) == ["What is 1000+1?"]  # the training problem is dropped
    assert len(t.prompts()) == 200
    with pytest.raises(ValueError, match="heldout_path"):
        build_task(DataConfig(task="math", path=data.path, max_prompt_tokens=64)).heldout_prompts(5)
