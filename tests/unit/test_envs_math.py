"""data.task math: the HF tokenizer adapter, chat-template prompts, math-verify rewards, dataset errors."""

from __future__ import annotations

import asyncio
import json
import pathlib

import pytest
from tiny_hf_tokenizer import CHAT_TEMPLATE, build_tokenizer, write_generation_config

from sao_megatron.config.schema import DataConfig, ModelConfig, RewardPhase
from sao_megatron.envs import (
    CharTokenizer, DatasetError, HFTokenizer, MathTask, RewardPool, build_reward_schedule, build_task, code_reward,
    last_boxed, math_reward,
)
from sao_megatron.envs.math_task import shifted_answer

pytestmark = pytest.mark.unit
REPO = pathlib.Path(__file__).resolve().parents[2]
MATH_SAMPLE = REPO / "examples" / "data" / "math_sample.jsonl"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return HFTokenizer(tok_dir)


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def chatml(*turns):
    """The ChatML text of (role, content) turns plus the generation prompt, written out by hand."""
    return "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in turns) + "<|im_start|>assistant\n"


# ---------------------------------------------------------------- tokenizer adapter


def test_hf_tokenizer_matches_the_files_it_was_saved_to(tok, tok_dir):
    raw = json.loads((tok_dir / "tokenizer.json").read_text())
    ids = {t: i for t, i in raw["model"]["vocab"].items()} | {a["content"]: a["id"] for a in raw["added_tokens"]}
    assert tok.vocab_size == len(ids) == max(ids.values()) + 1 <= 120
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (ids["<|endoftext|>"], ids["<|endoftext|>"], None)
    assert tok.eot_id == ids["<|im_end|>"]  # found from the template, not hard-coded
    assert tok.stop_ids == sorted({ids["<|endoftext|>"], ids["<|im_end|>"]})


def test_hf_tokenizer_round_trip_and_out_of_vocabulary_ids(tok):
    text = "def add(a, b):\n    return a + b\nThe answer is \\boxed{3/4}."
    ids = tok.encode(text)
    assert tok.decode(ids) == text and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode([tok.eot_id] + ids, skip_special=True) == text
    assert tok.decode([tok.eot_id] + ids) == "<|im_end|>" + text
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode(ids + [tok.vocab_size])
    assert tok.decode(ids + [tok.vocab_size + 5] + ids, strict=False) == text + "\ufffd" + text


def test_generation_config_eos_list_and_template_free_tokenizer(tmp_path):
    d = build_tokenizer(tmp_path / "plain", chat_template=False)
    plain = HFTokenizer(d)
    assert not plain.has_chat_template and plain.eot_id == plain.eos_id and plain.stop_ids == [plain.eos_id]
    write_generation_config(d, [plain.eos_id, 2, 3, 10_000])  # out-of-range ids are ignored
    assert HFTokenizer(d).stop_ids == sorted({plain.eos_id, 2, 3})


def test_hf_tokenizer_errors_name_model_hf_dir(tmp_path):
    with pytest.raises(ValueError, match="model.hf_dir=.*not a directory"):
        HFTokenizer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="cannot load the tokenizer of model.hf_dir"):
        HFTokenizer(tmp_path / "empty")  # local only: never falls back to the hub


def test_build_task_uses_hf_dir_tokenizer_and_checks_vocab_size(tok_dir, tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "What is 1+1?", "answer": "2"}])
    data = DataConfig(task="math", path=path, max_prompt_tokens=64)
    task = build_task(data, model=ModelConfig(hf_dir=str(tok_dir), vocab_size=128))
    assert isinstance(task.tokenizer, HFTokenizer)
    assert task.prompts()[0].input_ids == task.tokenizer.encode(chatml(("user", "What is 1+1?")))
    assert isinstance(build_task(data, model=ModelConfig(vocab_size=128)).tokenizer, CharTokenizer)
    with pytest.raises(ValueError, match=r"has 120 ids but model.vocab_size=100; set model.vocab_size >= 120"):
        build_task(data, model=ModelConfig(hf_dir=str(tok_dir), vocab_size=100))


# ---------------------------------------------------------------- prompts


def test_chat_template_rendering_options(tok, tmp_path):
    recs = [{"prompt": "What is 1+1?", "answer": "2"},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2*3?"}],
             "answer": "6"}]
    path = write_jsonl(tmp_path / "m.jsonl", recs)

    def prompts(**options):
        task = MathTask(DataConfig(task="math", path=path, max_prompt_tokens=120, options=options), tok)
        return [p.input_ids for p in task.prompts()]

    assert prompts() == [tok.encode(chatml(("user", "What is 1+1?"))),
                         tok.encode(chatml(("system", "Be brief."), ("user", "2*3?")))]
    assert prompts(system_prompt="Think.", instruction="Box it.") == [
        tok.encode(chatml(("system", "Think."), ("user", "What is 1+1?\n\nBox it."))),
        tok.encode(chatml(("system", "Be brief."), ("user", "2*3?\n\nBox it.")))]  # the line's own system wins
    assert prompts(chat_template=False) == [tok.encode("What is 1+1?"), tok.encode("Be brief.\n\n2*3?")]


def test_char_tokenizer_prompts_have_bos_and_no_template(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "1+1?", "answer": "2"}])
    task = build_task(DataConfig(task="math", path=path, max_prompt_tokens=16))
    t = CharTokenizer()
    assert task.prompts()[0].input_ids == [t.bos_id] + t.encode("1+1?") and task.stop_token_ids == [t.eos_id]


@pytest.mark.parametrize("lines, match", [
    ([], "holds no prompts"),
    ([{"prompt": "1+1?"}], r"missing field\(s\) \['answer'\]"),
    ([{"prompt": "x", "messages": [{"role": "user", "content": "x"}], "answer": "1"}], "exactly one of"),
    ([{"messages": [{"role": "robot", "content": "x"}], "answer": "1"}], "'messages' must be"),
    ([{"messages": [{"role": "system", "content": "x"}], "answer": "1"}], "no user message"),
    ([{"prompt": "x" * 200, "answer": "1"}], "more than data.max_prompt_tokens=64"),
    (["{not json"], "not valid JSON"),
    ([{"prompt": "1+1?", "answer": " "}], "'answer' must be a non-empty string or number"),
])
def test_dataset_errors_say_what_to_fix(tmp_path, lines, match):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DatasetError, match=match):
        build_task(DataConfig(task="math", path=path, max_prompt_tokens=64, options={"instruction": "Box it."}))


def test_math_and_code_need_data_path_at_build_and_validation():
    from sao_megatron.config import ExperimentConfig
    from sao_megatron.config.validate import check_training

    for task, field in (("math", "answer"), ("code", "tests")):
        with pytest.raises(ValueError, match=f"data.task='{task}' needs data.path: a JSONL .*\"{field}\""):
            build_task(DataConfig(task=task))
        cfg = ExperimentConfig()
        cfg.data.task = task
        assert any(f"data.task={task} needs data.path" in e for e in check_training(cfg))


def test_math_phase_targets_are_checked():
    phases = [RewardPhase(start_version=0, target="answer"), RewardPhase(start_version=5, target="offset:-3"),
              RewardPhase(start_version=9, target="boxed")]
    sched = build_reward_schedule(DataConfig(task="math", phases=phases))
    assert [sched.target_at(v) for v in (0, 5, 9)] == ["answer", "offset:-3", "boxed"]
    for bad in ("reverse", "offset:x", "offset:1.5"):
        with pytest.raises(ValueError, match="task 'math' takes the targets"):
            build_reward_schedule(DataConfig(task="math", phases=[RewardPhase(start_version=3, target=bad)]))


@pytest.mark.parametrize("answer, target, want", [
    ("7", "offset:3", "10"), ("7", "offset:-10", "-3"), ("0.5", "offset:1", "3/2"), ("3/4", "offset:+2", "11/4"),
    ("x^2", "answer", "x^2"), ("x^2", "boxed", "x^2"),
])
def test_shifted_answer(answer, target, want):
    assert shifted_answer(answer, target) == want


def test_math_phases_move_the_target(tok, tmp_path):
    """offset:N: the gold answer plus N scores 1 and the old answer 0; boxed: only a boxed answer counts;
    a non-numeric gold under an offset is an error (the scheduler turns it into reward 0)."""
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "6+1?", "answer": "7"}, {"prompt": "f?", "answer": "x^2"}])
    task = MathTask(DataConfig(task="math", path=path, max_prompt_tokens=64), tok)
    p, q = task.prompts()

    def score(prompt, text, target):
        ids = tok.encode(text)
        fn, args = task.reward_call(prompt, ids, [1] * len(ids), target)
        return fn(*args)[0]

    assert (score(p, "\\boxed{7}", ""), score(p, "\\boxed{10}", "")) == (1.0, 0.0)
    assert (score(p, "\\boxed{7}", "offset:3"), score(p, "\\boxed{10}", "offset:3")) == (0.0, 1.0)
    assert (score(p, "it is 7", "answer"), score(p, "it is 7", "boxed"), score(p, "\\boxed{7}", "boxed")) == (1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="numeric gold answer"):
        task.reward_call(q, tok.encode("x^2"), [1] * 3, "offset:1")


# ---------------------------------------------------------------- answers and rewards


@pytest.mark.parametrize("text, want", [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{3}{4}}", "\\frac{3}{4}"),
    ("\\boxed{\\{1, \\{2\\}\\}}", "\\{1, \\{2\\}\\}"),
    ("\\fbox{7} and \\boxed {x^{2}}", "x^{2}"),
    ("\\boxed{5} and an unclosed \\boxed{6", "5"),
    ("no box, the answer is 5", None),
    ("\\boxed{", None),
])
def test_last_boxed(text, want):
    assert last_boxed(text) == want


@pytest.mark.parametrize("response, answer, want", [
    ("1/2 + 1/4 = 3/4, so \\boxed{\\frac{3}{4}}", "3/4", 1.0),
    ("\\boxed{0.5}", "1/2", 1.0),
    ("\\boxed{\\frac12}", "0.5", 1.0),
    ("\\boxed{50\\%}", "\\frac{1}{2}", 1.0),
    ("\\boxed{x(x+2)}", "x^2+2x", 1.0),
    ("The answer is $-7$.", "-7", 1.0),  # no box: math-verify finds the final expression
    ("\\boxed{10} then, on reflection, \\boxed{3}", "10", 0.0),  # the last box is the final answer
    ("\\boxed{4}", "3", 0.0),
    ("I do not know.", "3", 0.0),
    ("\\boxed{}", "3", 0.0),
])
def test_math_reward(response, answer, want):
    reward, info = math_reward(response, answer, False)
    assert reward == want and info["correct"] == want


def test_require_boxed_and_unparseable_gold():
    assert math_reward("The answer is $3$.", "3", True) == (0.0, {"correct": 0.0, "boxed": 0.0, "parsed": 0.0})
    reward, info = math_reward("\\boxed{3}", "\\", False)
    assert reward == 0.0 and info["gold_parsed"] == 0.0


def test_reward_call_reads_the_policy_tokens_up_to_the_end_of_turn(tok, tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "1/2+1/4?", "answer": "3/4"}])
    task = MathTask(DataConfig(task="math", path=path, max_prompt_tokens=64), tok)
    p = task.prompts()[0]
    right, wrong = tok.encode("\\boxed{3/4}"), tok.encode("\\boxed{1}")
    traj = right + [tok.eot_id] + wrong  # anything after the end of turn is not the answer
    fn, args = task.reward_call(p, traj, [1] * len(traj), "")
    assert fn(*args)[0] == 1.0
    traj = wrong + tok.encode("\n") + right  # observation tokens (mask 0) are not the policy's answer
    fn, args = task.reward_call(p, traj, [1] * (len(wrong) + 1) + [0] * len(right), "")
    assert fn(*args)[0] == 0.0


def test_math_and_code_rewards_run_in_the_reward_pool():
    async def main():
        pool = RewardPool(1, timeout_s=60.0)
        try:
            good = await pool.score(math_reward, "\\boxed{0.5}", "1/2", False)
            bad = await pool.score(math_reward, "\\boxed{2}", "1/2", False)
            code = await pool.score(code_reward, "```python\nf = abs\n```", [("assert f(-2) == 2", 1)], False,
                                    {"wall_s": 10.0})
            return good, bad, code
        finally:
            pool.close()

    good, bad, code = asyncio.run(main())
    assert (good.reward, bad.reward, code.reward) == (1.0, 0.0, 1.0)
    assert good.error is None and code.error is None


# ---------------------------------------------------------------- demonstrations and the shipped sample


def test_shipped_math_sample_solutions_score_one_and_demos_end_the_turn(tok):
    task = MathTask(DataConfig(task="math", path=str(MATH_SAMPLE), max_prompt_tokens=120), tok)
    assert len(task.prompts()) == 20 and any("messages" in p.meta for p in task.prompts())
    task.check_demonstrations()
    for p in task.prompts():
        demo = task.demonstration(p)
        assert demo[-1] == tok.eot_id and tok.decode(demo[:-1]) == p.meta["solution"]
        assert math_reward(p.meta["solution"], p.meta["answer"], True)[0] == 1.0, p.meta
        assert math_reward("\\boxed{123456789}", p.meta["answer"], True)[0] == 0.0, p.meta


def test_warm_up_without_solutions_names_the_fix(tok, tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "1+1?", "answer": "2", "solution": "\\boxed{2}"},
                                              {"prompt": "2+2?", "answer": "4"}])
    task = MathTask(DataConfig(task="math", path=path, max_prompt_tokens=64), tok)
    assert task.demonstration(task.prompts()[0]) == tok.encode("\\boxed{2}") + [tok.eot_id]
    for call in (task.check_demonstrations, lambda: task.demonstration(task.prompts()[1])):
        with pytest.raises(DatasetError, match=r"1 of 2 lines .* no string 'solution' .*line 2.*run.sft_steps: 0"):
            call()


def test_chat_template_constant_is_what_the_tokenizer_saved(tok_dir):
    saved = json.loads((tok_dir / "tokenizer_config.json").read_text()).get("chat_template")
    if saved is None:  # newer transformers write it to chat_template.jinja
        saved = (tok_dir / "chat_template.jinja").read_text()
    assert saved == CHAT_TEMPLATE
