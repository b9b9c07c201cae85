"""The CPU study task: problem space, tool, demonstrations, trajectories and rewards."""

from __future__ import annotations

import pytest

from sao_megatron.config.schema import DataConfig
from sao_megatron.envs import build_task
from sao_megatron.envs.tool_chain import binary_tool

pytestmark = pytest.mark.unit


def _slow_left_to_right(text: str) -> int:
    """Reference: evaluate 'a op b op c' strictly left to right, one character at a time."""
    tokens, cur = [], ""
    for ch in text.rstrip("="):
        if ch in "+-*" and cur:
            tokens += [int(cur), ch]
            cur = ""
        else:
            cur += ch
    tokens.append(int(cur))
    acc = tokens[0]
    for i in range(1, len(tokens), 2):
        acc = {"+": acc + tokens[i + 1], "-": acc - tokens[i + 1], "*": acc * tokens[i + 1]}[tokens[i]]
    return acc


def _task(**opts):
    return build_task(DataConfig(task="tool_chain", num_prompts=4000, max_prompt_tokens=16, options=opts))


def test_problem_space_answers_and_lengths():
    t = _task()
    prompts = t.prompts()
    assert len({p.meta["prompt"] for p in prompts}) > 3900  # thousands of distinct problems
    for p in prompts[:500]:
        assert int(p.meta["answer"]) == _slow_left_to_right(p.meta["prompt"])
        demo = t.demonstration(p)
        assert 10 <= len(demo) <= 40 and len(t.demonstration_mask(p)) == len(demo)


def test_binary_tool_is_one_operation_only():
    assert binary_tool("12+34") == "46" and binary_tool("-7-5") == "-12" and binary_tool("3*4") == "12"
    for bad in ("1+2+3", "__import__('os')", "", "1+", "(1+2)"):
        assert binary_tool(bad) is None


def test_demonstration_replayed_through_the_env_scores_one():
    """Drive the real env with the demonstration's action turns: the observations it returns must be
    the demonstration's observation tokens, and the outcome reward must be exactly 1."""
    t, tok = _task(), _task().tokenizer
    for p in t.prompts()[:50]:
        demo, mask = t.demonstration(p), t.demonstration_mask(p)
        env, traj, tmask, i = t.make_env(), [], [], 0
        env.reset(p)
        turn_rewards = []
        while i < len(demo):
            j = i
            while j < len(demo) and mask[j] == 1 and (j == i or demo[j - 1] not in (tok.call_end_id, tok.eos_id)):
                j += 1
            action = demo[i:j]
            step = env.step(action, finish_reason="stop")
            traj += action + step.observation_ids
            tmask += [1] * len(action) + [0] * len(step.observation_ids)
            turn_rewards.append(step.reward)
            i = j + len(step.observation_ids)
            if step.done:
                break
        assert traj == demo and tmask == mask
        assert turn_rewards == [0.05, 0.05, 0.0]
        fn, args = t.reward_call(p, traj, tmask, "")
        assert fn(*args)[0] == 1.0


def test_wrong_answer_and_error_observation():
    t = _task()
    tok, p = t.tokenizer, t.prompts()[0]
    env = t.make_env()
    step = env.step([tok.call_id] + tok.encode("1+2+3") + [tok.call_end_id], finish_reason="stop")
    assert tok.decode(step.observation_ids) == "<obs>error</obs>" and step.reward == 0.0
    wrong = str(int(p.meta["answer"]) + 1)
    fn, args = t.reward_call(p, tok.encode(wrong) + [tok.eos_id], [1] * (len(wrong) + 1), "")
    assert fn(*args)[0] < 1.0


def test_random_demo_answers_keep_the_tool_calls_and_miss_the_answer():
    t, ref = _task(demo_answers="random"), _task()
    tok = t.tokenizer
    for p in t.prompts()[:200]:
        demo, good = t.demonstration(p), ref.demonstration(p)
        last_obs = len(good) - 1 - good[::-1].index(tok.obs_end_id)
        assert demo[:last_obs + 1] == good[:last_obs + 1]  # calls and observations unchanged
        answer = tok.decode(demo[last_obs + 1:-1])
        assert demo[-1] == tok.eos_id and answer != p.meta["answer"] and int(answer) == int(answer.strip())
        assert len(t.demonstration_mask(p)) == len(demo)
