"""Tasks, tokenizer, datasets and the reward schedule."""

from __future__ import annotations

import json
import random

import pytest

from sao_megatron.config.schema import DataConfig, RewardPhase
from sao_megatron.envs import (
    ArithmeticTask, CalculatorTask, CharTokenizer, DatasetError, RewardSchedule, arithmetic_reward,
    build_reward_schedule, build_task, load_jsonl,
)

pytestmark = pytest.mark.unit
TOK = CharTokenizer()


def test_char_tokenizer_round_trip_and_hf_equivalence(tmp_path):
    from transformers import AutoTokenizer

    text = "".join(chr(c) for c in range(32, 127)) + "\n12*(3+4)=84\n"
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text and TOK.vocab_size == 103 <= 128
    assert len(set(ids)) == 96 and min(ids) == 7  # one id per character, specials below
    TOK.save_hf_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf(text, add_special_tokens=False)["input_ids"] == ids
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (TOK.pad_id, TOK.bos_id, TOK.eos_id)
    special = [TOK.bos_id, TOK.call_id] + TOK.encode("1+1") + [TOK.call_end_id, TOK.eos_id]
    assert hf.decode(special) == "<bos><call>1+1</call><eos>" == TOK.decode(special)
    assert TOK.decode(special, skip_special=True) == "1+1"
    with pytest.raises(ValueError, match="'é' is not in"):
        TOK.encode("café")
    assert TOK.encode("café", strict=False) == TOK.encode("caf")
    assert TOK.decode([120, 20], strict=False) == "\ufffd" + TOK.decode([20])


def _slow_answer(text: str) -> int:
    """Reference evaluation with explicit precedence (no eval)."""
    nums, ops, cur = [], [], ""
    for ch in text.rstrip("="):
        if ch.isdigit():
            cur += ch
        else:
            nums.append(int(cur))
            ops.append(ch)
            cur = ""
    nums.append(int(cur))
    terms, signs = [nums[0]], []
    for op, n in zip(ops, nums[1:]):
        if op == "*":
            terms[-1] *= n
        else:
            terms.append(n)
            signs.append(op)
    total = terms[0]
    for op, t in zip(signs, terms[1:]):
        total = total + t if op == "+" else total - t
    return total


def test_arithmetic_prompts_follow_the_options_and_demonstrations_score_one():
    task = ArithmeticTask(num_prompts=300, seed=7, options={"min_operand": 2, "max_operand": 30,
                                                             "num_operands": 3, "ops": "+-*"})
    again = ArithmeticTask(num_prompts=300, seed=7, options={"min_operand": 2, "max_operand": 30,
                                                              "num_operands": 3, "ops": "+-*"})
    assert [p.input_ids for p in task.prompts()] == [p.input_ids for p in again.prompts()]  # seeded
    for p in task.prompts():
        text = p.meta["prompt"]
        assert p.input_ids == [TOK.bos_id] + TOK.encode(text)
        nums = [int(x) for x in text.rstrip("=").replace("*", "+").replace("-", "+").split("+")]
        assert len(nums) == 3 and all(2 <= n <= 30 for n in nums)
        assert p.meta["answer"] == str(_slow_answer(text))
        demo = task.demonstration(p)
        fn, args = task.reward_call(p, demo, task.demonstration_mask(p), "")
        assert fn(*args)[0] == 1.0


def test_arithmetic_reward_exact_shaped_and_targets():
    assert arithmetic_reward("42", True, "42", "", True, 0.1, 0.4) == (1.0, {"exact": 1.0})
    assert arithmetic_reward("42", False, "42", "", True, 0.1, 0.4)[0] == pytest.approx(0.4)  # no eos
    assert arithmetic_reward("43", True, "42", "", True, 0.1, 0.4)[0] == pytest.approx(0.1 + 0.4 * 0.5)
    assert arithmetic_reward("4x", True, "42", "", True, 0.1, 0.4)[0] == pytest.approx(0.4 * 0.5)
    assert arithmetic_reward("43", True, "42", "", False, 0.1, 0.4)[0] == 0.0
    assert arithmetic_reward("24", True, "42", "reverse", True, 0.1, 0.4)[0] == 1.0
    assert arithmetic_reward("45", True, "42", "offset:3", True, 0.1, 0.4)[0] == 1.0
    assert arithmetic_reward("42", True, "42", "offset:3", False, 0.1, 0.4)[0] == 0.0


def test_random_responses_get_shaped_reward_below_exact():
    rng = random.Random(0)
    task = ArithmeticTask(num_prompts=50)
    for p in task.prompts():
        resp = TOK.encode(str(rng.randint(0, 20))) + [TOK.eos_id]
        fn, args = task.reward_call(p, resp, [1] * len(resp), "")
        r = fn(*args)[0]
        exact = TOK.decode(resp[:-1]) == p.meta["answer"]
        assert r == 1.0 if exact else 0.1 <= r <= 0.5


def test_reward_schedule_phases():
    sched = RewardSchedule([RewardPhase(start_version=10, target="reverse"), RewardPhase(start_version=25,
                                                                                     target="offset:1")])
    assert [sched.phase_at(v) for v in (0, 9, 10, 24, 25, 100)] == [0, 0, 1, 1, 2, 2]
    assert [sched.target_at(v) for v in (0, 10, 30)] == ["", "reverse", "offset:1"]
    with pytest.raises(ValueError, match="not one of"):
        build_reward_schedule(DataConfig(phases=[RewardPhase(start_version=3, target="shout")]))
    with pytest.raises(ValueError, match="same version"):
        RewardSchedule([RewardPhase(start_version=3, target="a"), RewardPhase(start_version=3, target="b")])


def test_jsonl_dataset_loading_and_errors(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n\n"
                    + json.dumps({"input_ids": [1, 24, 18, 25, 36], "answer": "3"}) + "\n")
    prompts = load_jsonl(good, TOK, max_prompt_tokens=8, required=("answer",))
    assert [p.index for p in prompts] == [0, 1] and prompts[0].input_ids == [1] + TOK.encode("1+2=")
    assert prompts[1].input_ids == [1, 24, 18, 25, 36] and prompts[1].meta == {"answer": "3"}
    cases = {
        "missing.jsonl": (None, "no such file"),
        "empty.jsonl": ("\n  \n", "holds no prompts"),
        "bad.jsonl": ('{"prompt": "1+1=", "answer": "2"}\n{oops\n', r"bad.jsonl:2: not valid JSON"),
        "long.jsonl": (json.dumps({"prompt": "1" * 20, "answer": "1"}), "21 tokens, more than data.max_prompt_tokens=8"),
        "noans.jsonl": (json.dumps({"prompt": "1+1="}), "missing field"),
        "both.jsonl": (json.dumps({"prompt": "1", "input_ids": [1], "answer": "1"}), "exactly one of"),
        "ids.jsonl": (json.dumps({"input_ids": [1, 500], "answer": "1"}), "input_ids must be"),
        "chars.jsonl": (json.dumps({"prompt": "1÷1=", "answer": "1"}), "not in the char tokenizer"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        if content is not None:
            path.write_text(content)
        with pytest.raises(DatasetError, match=message):
            load_jsonl(path, TOK, max_prompt_tokens=8, required=("answer",))


def test_build_task_from_config(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "2*3=", "answer": "6"}) + "\n")
    task = build_task(DataConfig(task="arithmetic", path=str(path)))
    assert len(task.prompts()) == 1 and task.demonstration(task.prompts()[0]) == TOK.encode("6") + [TOK.eos_id]
    assert isinstance(build_task(DataConfig(task="calculator", num_prompts=5)), CalculatorTask)
    with pytest.raises(ValueError, match="unknown; choose one of"):
        build_task(DataConfig(task="chess"))
    with pytest.raises(ValueError, match="unknown option"):
        build_task(DataConfig(options={"max_operands": 3}))
    with pytest.raises(ValueError, match="must be a int"):
        build_task(DataConfig(options={"max_operand": "9"}))
    with pytest.raises(ValueError, match="max_prompt_tokens=4 is below"):
        build_task(DataConfig(max_prompt_tokens=4, options={"num_operands": 3}))


@pytest.mark.component  # the tool runs in the sandbox
def test_calculator_env_steps_and_demonstration():
    task = CalculatorTask(num_prompts=10, seed=1)
    p = task.prompts()[0]
    expr, ans = p.meta["prompt"].rstrip("="), p.meta["answer"]
    env = task.make_env()
    assert env.reset(p) == p.input_ids
    call = [TOK.call_id] + TOK.encode(expr) + [TOK.call_end_id]
    step = env.step(call, finish_reason="stop")
    assert not step.done and step.reward == 0.1
    assert step.observation_ids == [TOK.obs_id] + TOK.encode(ans) + [TOK.obs_end_id]
    # engine trimmed the stop token: the environment closes the call itself (glue, masked)
    step = env.step(call[:-1], finish_reason="stop")
    assert step.observation_ids[0] == TOK.call_end_id and step.observation_ids[1] == TOK.obs_id
    bad = env.step([TOK.call_id] + TOK.encode("__import__('os')") + [TOK.call_end_id], finish_reason="stop")
    assert bad.reward == 0.0 and TOK.decode(bad.observation_ids).startswith("<obs>error")
    slow = env.step([TOK.call_id] + TOK.encode("9**9**9") + [TOK.call_end_id], finish_reason="stop")
    assert TOK.decode(slow.observation_ids) == "<obs>error: time limit</obs>"
    final = TOK.encode(ans) + [TOK.eos_id]
    assert env.step(final, finish_reason="stop").done
    demo, mask = task.demonstration(p), task.demonstration_mask(p)
    assert demo == call + [TOK.obs_id] + TOK.encode(ans) + [TOK.obs_end_id] + final
    assert mask == [1] * len(call) + [0] * (len(ans) + 2) + [1] * len(final)
    fn, args = task.reward_call(p, demo, mask, "")
    assert fn(*args)[0] == 1.0
    wrong = demo[:-2] + [TOK.encode("9")[0] if demo[-2] != TOK.encode("9")[0] else TOK.encode("8")[0], TOK.eos_id]
    fn, args = task.reward_call(p, wrong, mask, "")
    assert fn(*args)[0] == 0.0
