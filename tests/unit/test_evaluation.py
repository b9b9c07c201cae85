"""Held-out evaluation: a scripted engine on the real multi-turn env and rewards, metric maths, the
periodic schedule and the eval config section."""

from __future__ import annotations

import asyncio

import pytest

from sao_megatron.config import load_config
from sao_megatron.config.schema import DataConfig, EvalConfig
from sao_megatron.envs import build_task
from sao_megatron.envs.rewards import RewardOutcome
from sao_megatron.rollout.types import GenerateResult, SamplingParams
from sao_megatron.algorithms.stats import wilson_interval
from sao_megatron.training.run.evaluation import EvalResult, PeriodicEval, evaluate_prompts

pytestmark = pytest.mark.unit


class _ScriptedEngine:
    """Replies with the demonstration's next action turn; for prompts in ``wrong`` the answer turn is off by one."""

    def __init__(self, task, wrong: set[str]):
        self.task, self.wrong = task, wrong
        self.by_prompt = {tuple(p.input_ids): p for p in task.heldout_prompts(10_000)}

    async def generate(self, input_ids, sampling, *, rid=None, return_routed_experts=False, avoid=frozenset()):
        tok = self.task.tokenizer
        for n in range(len(input_ids), 0, -1):
            p = self.by_prompt.get(tuple(input_ids[:n]))
            if p is not None:
                break
        demo, done = self.task.demonstration(p), len(input_ids) - n
        out = []
        for t in demo[done:]:
            out.append(t)
            if t in (tok.call_end_id, tok.eos_id):
                break
        if out[-1] == tok.eos_id and p.meta["prompt"] in self.wrong:
            out = tok.encode(str(int(p.meta["answer"]) + 1)) + [tok.eos_id]
        return GenerateResult(rid=rid or "", output_ids=out, logprobs=[0.0] * len(out), versions=[0] * len(out),
                              finish_reason="stop", prompt_tokens=len(input_ids), weight_version=0,
                              routed_experts=None, engine_url="scripted", latency_s=0.0)

    async def abort_request(self, rid):
        pass


class _InlinePool:
    async def score(self, fn, *args):
        reward, info = fn(*args)
        return RewardOutcome(reward, info)


def test_evaluate_prompts_counts_exact_answers_on_the_multi_turn_task():
    task = build_task(DataConfig(task="tool_chain", num_prompts=500, max_prompt_tokens=16))
    prompts = task.heldout_prompts(40)
    wrong = {p.meta["prompt"] for p in prompts[::4]}  # 10 of 40 answered wrongly
    engine = _ScriptedEngine(task, wrong)
    result = asyncio.run(evaluate_prompts(engine, task, prompts, SamplingParams(max_new_tokens=12), max_turns=3,
                                          max_total_tokens=64, reward_pool=_InlinePool()))
    assert result.passed == [p.meta["prompt"] not in wrong for p in prompts]
    m = result.metrics()
    assert m["eval/pass_at_1"] == 30 / 40 and (m["eval/ci_low"], m["eval/ci_high"]) == wilson_interval(30, 40)
    assert 0.75 < m["eval/mean_reward"] < 1.0  # wrong answers keep partial (digit/format) credit


def test_eval_result_metrics_by_hand():
    m = EvalResult([1.0, 0.0, 1.0, 0.5]).metrics()
    assert m["eval/pass_at_1"] == 0.5 and m["eval/mean_reward"] == 0.625 and m["eval/num_prompts"] == 4
    assert m["eval/reward_ci_low"] < 0.625 < m["eval/reward_ci_high"]


class _FakeRollout:
    """What maybe_run uses of the trainer's RolloutSide: bridge.run, client, scheduler.reward_pool."""

    def __init__(self, task):
        self.client = _ScriptedEngine(task, set())
        self.scheduler = type("S", (), {"reward_pool": _InlinePool()})()
        self.bridge = type("B", (), {"run": staticmethod(lambda coro: asyncio.run(coro))})()


def test_periodic_eval_schedule_and_fields_reach_code():
    task = build_task(DataConfig(task="tool_chain", num_prompts=500, max_prompt_tokens=16, max_turns=3,
                                 max_total_tokens=64))
    pe = PeriodicEval(EvalConfig(interval=4, num_prompts=12, temperature=0.0), task,
                      DataConfig(task="tool_chain", max_turns=3, max_total_tokens=64), max_new_tokens=12, num_steps=10)
    assert [s for s in range(11) if pe.due(s)] == [4, 8, 10]
    assert len(pe.prompts) == 12 and pe.sampling.temperature == 0.0
    assert pe.maybe_run(3, _FakeRollout(task), 3) == {}
    assert pe.maybe_run(4, _FakeRollout(task), 4)["eval/pass_at_1"] == 1.0
    off = PeriodicEval(EvalConfig(), task, DataConfig(), max_new_tokens=4, num_steps=10)
    assert not any(off.due(s) for s in range(11)) and off.prompts == []
    assert pe.before_training(_FakeRollout(task), 0) == {}  # eval.before_train off
    start = PeriodicEval(EvalConfig(num_prompts=5, before_train=True), task,
                         DataConfig(task="tool_chain", max_turns=3, max_total_tokens=64), max_new_tokens=12, num_steps=10)
    assert not any(start.due(s) for s in range(11)) and len(start.prompts) == 5  # interval 0: only the start
    m = start.before_training(_FakeRollout(task), 0)
    assert m["eval_start/pass_at_1"] == 1.0 and m["eval_start/num_prompts"] == 5 and "eval/pass_at_1" not in m
    with pytest.raises(ValueError, match="eval: need interval >= 0"):
        PeriodicEval(EvalConfig(interval=-1), task, DataConfig(), max_new_tokens=4, num_steps=10)


def test_eval_section_loads_strictly():
    cfg = load_config("configs/experiments/tool_chain_cpu.yaml", ["eval.num_prompts=7"])
    assert (cfg.eval.interval, cfg.eval.num_prompts, cfg.eval.temperature) == (10, 7, 0.0)
    with pytest.raises(Exception, match="eval.nonsense"):
        load_config("configs/experiments/tool_chain_cpu.yaml", ["eval.nonsense=1"])


def test_report_draws_heldout_eval_only_when_present(tmp_path):
    import json

    from sao_megatron.training.verbs.report import write_report

    recs = [{"step": i, "reward/mean": 0.1 * i} for i in range(6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert "heldout_eval.png" not in {p.name for p in write_report(tmp_path, tmp_path / "r1")}
    recs[5] |= {"eval/pass_at_1": 0.5, "eval/ci_low": 0.3, "eval/ci_high": 0.7, "eval/mean_reward": 0.6}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    written = {p.name: p for p in write_report(tmp_path, tmp_path / "r2")}
    assert written["heldout_eval.png"].stat().st_size > 1000
    # eval.before_train: the starting point is drawn first, at step -1
    recs[0] |= {"eval_start/pass_at_1": 0.1, "eval_start/ci_low": 0.0, "eval_start/ci_high": 0.3,
                "eval_start/mean_reward": 0.2}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    from sao_megatron.training.verbs import report

    drawn = []
    real = report._eval_figure

    def spy(plt, records):
        fig = real(plt, records)
        drawn.append([list(line.get_xdata()) for line in fig.axes[0].get_lines()])
        return fig
    report._eval_figure = spy
    try:
        write_report(tmp_path, tmp_path / "r3")
    finally:
        report._eval_figure = real
    assert drawn == [[[-1, 5], [-1, 5]]]
