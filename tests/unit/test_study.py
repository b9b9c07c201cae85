"""The study harness: plan at an equal sample budget, resumable execution, tables from metrics."""

from __future__ import annotations

import dataclasses

import csv
import math
import sys

import pytest

from sao_megatron.cli import main
from sao_megatron.study import runner
from sao_megatron.study.spec import build_plan, load_study, select_variants
from sao_megatron.study.summary import collect, run_stats, write_tables

pytestmark = pytest.mark.unit
STUDY = "configs/studies/paper-miniature.yaml"
TODAY = ["sao", "grpo", "grpo_dis", "grpo_dis_equal_diversity", "sao_group_shaped", "running_mean", "full_critic",
         "critic_k1", "no_value_pretrain", "gae_plain", "sao_online", "grpo_online"]


def test_plan_shapes_and_equal_sample_budget(tmp_path):
    spec, base = load_study(STUDY)
    plan = build_plan(spec, base, tmp_path, variants=TODAY, seeds=2)
    assert not plan.errors and len(plan.runs) == 2 * len(TODAY)
    shape = {r.variant: (r.batch_size // r.group_size, r.group_size, r.num_steps) for r in plan.runs}
    b = 32
    assert shape["sao"] == (b, 1, 100) and shape["grpo"] == (b // 8, 8, 100) and shape["grpo_dis"] == (b // 8, 8, 100)
    assert shape["grpo_dis_equal_diversity"] == (b, 8, 12) and shape["sao_group_shaped"] == (b // 8, 8, 100)
    for r in plan.runs:  # equal sample budget, up to the rounding of a step
        assert spec.samples_per_run - r.batch_size < r.num_steps * r.batch_size <= spec.samples_per_run
    seeds = sorted({s for r in plan.runs if r.variant == "sao" for s in r.overrides if s.startswith("run.seed")})
    assert seeds == ["run.seed=1234", "run.seed=1235"]


def test_every_variant_of_the_full_matrix_loads_and_a_bad_one_is_reported_not_run(tmp_path):
    spec, base = load_study(STUDY)
    plan = build_plan(spec, base, tmp_path, variants=select_variants(spec, full=True, only=None), seeds=1)
    assert not plan.errors
    spec.variants["broken"] = dataclasses.replace(spec.variants["grpo"], overrides={"actor.no_such_key": 1})
    plan = build_plan(spec, base, tmp_path, variants=["sao", "broken"], seeds=1)
    assert set(plan.errors) == {"broken"} and "no_such_key" in plan.errors["broken"]
    assert select_variants(spec, full=False, only=None) == ["sao", "grpo", "grpo_dis"]
    with pytest.raises(ValueError, match="unknown"):
        select_variants(spec, full=False, only=["nope"])


def test_dry_run_prints_the_plan_and_an_estimate(tmp_path, capsys):
    assert main(["study", "--config", STUDY, "--out", str(tmp_path), "--dry-run", "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "sao " in out and "32x1" in out and "4x8" in out and "estimated time:" in out
    assert not any(tmp_path.iterdir())  # nothing ran


def _records(rewards, *, entropy=None, evals=None, phases=None, ev=None):
    recs = []
    for i, r in enumerate(rewards):
        rec = {"step": i, "reward/mean": r, "actor/dis_masked_low_frac": 0.01 * i, "actor/dis_masked_high_frac": 0.0}
        if entropy:
            rec["actor/entropy"] = entropy[i]
        if evals and i in evals:
            rec["eval/pass_at_1"] = evals[i]
        if phases:
            rec["rollout/phase"] = phases[i]
        if ev:
            rec["critic/explained_var"] = ev[i]
        recs.append(rec)
    return recs


def test_run_stats_by_hand():
    rewards = [0.1 * i for i in range(20)]
    s = run_stats(_records(rewards, entropy=[2.0] * 2 + [1.0] * 16 + [0.5] * 2, evals={9: 0.2, 19: 0.4},
                           ev=[0.5] * 16 + [0.1, 0.2, 0.3, 0.4]), threshold=0.5, online=False)
    assert s["heldout_pass_at_1"] == 0.4
    assert s["heldout_gain"] == pytest.approx(0.4 - 0.2)  # from the first evaluation
    assert s["final_reward"] == pytest.approx((1.8 + 1.9) / 2)
    assert s["reward_gain"] == pytest.approx((1.8 + 1.9) / 2 - (0.0 + 0.1) / 2)
    recs = _records(rewards, evals={9: 0.2, 19: 0.4})
    recs[0]["eval_start/pass_at_1"] = 0.05  # eval.before_train: gains count from the starting weights
    assert run_stats(recs, threshold=0.5, online=False)["heldout_gain"] == pytest.approx(0.35)
    # trailing 5-mean of 0.1*i reaches 0.5 at i=7 ((0.3+...+0.7)/5) -> 8 steps
    assert s["steps_to_threshold"] == 8
    assert s["entropy_ratio"] == pytest.approx(0.5 / 2.0)
    assert s["dis_masked_low"] == pytest.approx(sum(0.01 * i for i in range(20)) / 20)
    assert s["critic_explained_var"] == pytest.approx(0.25)
    assert math.isnan(s["adaptation_steps"])
    online = run_stats(_records([1.0] * 10 + [0.0, 0.0, 1.0] + [1.0] * 7, phases=[0] * 10 + [1] * 10),
                       threshold=0.5, online=True)
    assert online["adaptation_steps"] == 6  # trailing 5-mean >= 0.9 first at index 16 = 6 steps after the shift


def _fake_train(tmp_path):
    """A stand-in for `sao-megatron train`: writes metrics from its --set run.seed, fails on seed 1235 once."""
    script = tmp_path / "fake_train.py"
    script.write_text(
        "import json, pathlib, sys\n"
        "a = sys.argv\n"
        "run = pathlib.Path(a[a.index('--run-dir') + 1]); run.mkdir(parents=True, exist_ok=True)\n"
        "sets = {a[i + 1].split('=', 1)[0]: a[i + 1].split('=', 1)[1] for i, x in enumerate(a) if x == '--set'}\n"
        "seed, steps = int(sets['run.seed']), int(sets['run.num_steps'])\n"
        "flag = run / 'tried'\n"
        "if seed == 1235 and not flag.exists():\n"
        "    flag.write_text(''); sys.exit(3)\n"
        "with (run / 'metrics.jsonl').open('w') as f:\n"
        "    for i in range(steps):\n"
        "        f.write(json.dumps({'step': i, 'reward/mean': (seed - 1234) * 0.5, 'eval/pass_at_1': (seed - 1234) * 0.5}) + '\\n')\n")
    return script


def test_execute_is_resumable_and_tables_aggregate_over_seeds(tmp_path, monkeypatch):
    spec, base = load_study(STUDY)
    spec.samples_per_run = 64
    plan = build_plan(spec, base, tmp_path / "out", variants=["sao"], seeds=3)
    fake = _fake_train(tmp_path)
    monkeypatch.setattr(runner, "train_command", lambda p, r: [sys.executable, str(fake), "--run-dir", str(r.run_dir)]
                        + [x for s in r.overrides for x in ("--set", s)])
    failed = runner.execute(plan, 2, on_event=lambda m: None, poll_s=0.05)
    assert [r.seed_index for r in failed] == [1]
    assert [runner.is_done(r) for r in plan.runs] == [True, False, True]
    assert runner.estimate_seconds(plan, 1) > 0
    started = []
    assert runner.execute(plan, 2, on_event=started.append, poll_s=0.05) == []
    assert sum(m.startswith("start") for m in started) == 1  # finished runs are skipped
    md, csv_path = write_tables(collect(plan), tmp_path, threshold=0.5)
    row = next(csv.DictReader(csv_path.open()))
    assert row["variant"] == "sao" and row["seeds"] == "3"
    assert float(row["heldout_pass_at_1_mean"]) == pytest.approx(0.5)  # seeds give 0, 0.5, 1.0
    assert float(row["heldout_pass_at_1_high"]) - 0.5 == pytest.approx(4.302652729911275 * 0.5 / math.sqrt(3))
    assert "| sao | 32x1 | 3 | 0.500 ± 1.242" in md.read_text()


def test_paired_table_differences_seed_by_seed():
    """Variant minus reference on the same seed, against a hand recount; a seed only one side
    finished is left out. A shared per-seed offset (the warm-up) cancels: the paired interval is
    narrow where the unpaired ones are wide."""
    from sao_megatron.algorithms.stats import t_interval
    from sao_megatron.study.summary import VariantRow, paired, paired_table

    warmup = {0: 0.8, 1: 0.01, 2: 0.16, 3: 0.5}
    ref = VariantRow("sao", "32x1", "", seeds=[0, 1, 2],
                     runs=[{"heldout_pass_at_1": warmup[s] + 0.02 * s} for s in (0, 1, 2)])
    other = VariantRow("grpo", "4x8", "", seeds=[2, 0, 1, 3],
                       runs=[{"heldout_pass_at_1": warmup[s] - 0.05 + 0.01 * s} for s in (2, 0, 1, 3)])
    diffs = [(warmup[s] - 0.05 + 0.01 * s) - (warmup[s] + 0.02 * s) for s in (0, 1, 2)]
    mean, low, high, n = paired(other, ref, "heldout_pass_at_1")
    assert n == 3 and (mean, low, high) == pytest.approx(t_interval(diffs))
    assert high < 0  # the seeds support "grpo is lower"
    assert ref.agg("heldout_pass_at_1")[2] - ref.agg("heldout_pass_at_1")[1] > 10 * (high - low)
    table = "\n".join(paired_table([ref, other]))
    assert "| grpo | 3 | " + f"{mean:.3f} ± {(high - low) / 2:.3f}" in table
    assert paired_table([ref]) == []


def test_heldout_curve_starts_at_the_starting_weights():
    from sao_megatron.study.summary import _curve

    recs = _records([0.1] * 20, evals={9: 0.3, 19: 0.4})
    assert _curve(recs, "eval/pass_at_1") == ([9, 19], [0.3, 0.4])
    recs[0]["eval_start/pass_at_1"] = 0.2
    assert _curve(recs, "eval/pass_at_1") == ([-1, 9, 19], [0.2, 0.3, 0.4])  # drawn at 0 trained samples
    assert _curve(recs, "reward/mean")[0] == list(range(20))
