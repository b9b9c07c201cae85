"""The study harness: plan at an equal sample budget, resumable execution, tables from metrics."""

from __future__ import annotations

import dataclasses

import csv
import json
import math
import pathlib
import sys

import pytest

from sao_megatron.cli import main
from sao_megatron.study import runner
from sao_megatron.study.spec import build_plan, load_study, select_variants
from sao_megatron.study.summary import collect, run_stats, write_tables

pytestmark = pytest.mark.unit
STUDY = "configs/studies/paper-miniature.yaml"
FULL = ["sao", "grpo", "grpo_epochs", "grpo_dis", "grpo_dis_no_std", "grpo_dis_equal_diversity",
        "grpo_dis_equal_diversity_steps", "sao_staleness2", "sao_staleness4", "sao_group_shaped", "sao_fast_stale",
        "sao_fast_stale_no_mask", "ppo_fast_stale", "running_mean",
        "running_mean_exact", "full_critic", "critic_k1", "no_value_pretrain", "gae_plain", "sao_online",
        "grpo_online"]


def _sets(run) -> dict[str, str]:
    return dict(s.split("=", 1) for s in run.overrides)


def test_plan_shapes_and_equal_sample_budget(tmp_path):
    spec, base = load_study(STUDY)
    plan = build_plan(spec, base, tmp_path, variants=FULL, seeds=2, warmup_seeds=2)
    assert not plan.errors and len(plan.runs) == 2 * 2 * len(FULL)
    shape = {r.variant: (r.batch_size // r.group_size, r.group_size, r.num_steps) for r in plan.runs}
    b = 32
    n = spec.samples_per_run // b  # steps of a batch-B arm (200 at 6,400 samples)
    assert shape["sao"] == (b, 1, n) and shape["grpo"] == (b // 8, 8, n) and shape["grpo_dis"] == (b // 8, 8, n)
    assert shape["grpo_dis_equal_diversity"] == (b, 8, n // 8) and shape["sao_group_shaped"] == (b // 8, 8, n)
    # the equal-steps control: as many steps as SAO, 8x the samples
    assert shape["grpo_dis_equal_diversity_steps"] == (b, 8, shape["sao"][2])
    for r in plan.runs:  # equal sample budget, up to the rounding of a step (the equal-steps arm aside)
        if r.variant != "grpo_dis_equal_diversity_steps":
            assert spec.samples_per_run - r.batch_size < r.num_steps * r.batch_size <= spec.samples_per_run


def test_nested_design_every_arm_loads_the_shared_warmup_and_pairs_by_warmup_and_rl_seed(tmp_path):
    spec, base = load_study(STUDY)
    plan = build_plan(spec, base, tmp_path, variants=["sao", "grpo"], seeds=3, warmup_seeds=2)
    assert [w.index for w in plan.warmups] == [0, 1]
    assert [dict(s.split("=", 1) for s in w.overrides)["run.seed"] for w in plan.warmups] == ["1234", "1235"]
    assert all(w.actor.parent.parent == (tmp_path / "warmup").resolve() for w in plan.warmups)
    for arm in ("sao", "grpo"):
        runs = [r for r in plan.runs if r.variant == arm]
        assert sorted(r.pair for r in runs) == [(w, r) for w in (0, 1) for r in (0, 1, 2)]
        for r in runs:
            sets = _sets(r)
            assert sets["run.sft_steps"] == "0"  # no warm-up inside an arm
            assert sets["actor.load"] == f'"{plan.warmups[r.warmup_index].actor}"'
    # the same (warm-up, RL seed) gets the same RL seed in every arm, and distinct pairs distinct seeds
    seed = {(r.variant, r.pair): _sets(r)["run.seed"] for r in plan.runs}
    assert all(seed["sao", p] == seed["grpo", p] for _, p in seed)
    assert len({seed["sao", p] for _, p in seed}) == 6
    assert not {seed["sao", p] for _, p in seed} & {"1234", "1235"}  # never a warm-up's seed
    assert len({r.run_dir for r in plan.runs}) == len(plan.runs)


def test_every_variant_resolves_to_a_valid_config_and_a_bad_one_is_reported_not_run(tmp_path):
    from sao_megatron.config import load_config

    spec, base = load_study(STUDY)
    assert select_variants(spec, full=True, only=None) == FULL
    plan = build_plan(spec, base, tmp_path, variants=FULL, seeds=1, warmup_seeds=1)
    assert not plan.errors
    for r in plan.runs:  # each arm's exact --set list loads under strict validation
        load_config(base, r.overrides)
    assert select_variants(spec, full=False, only=None) == ["sao", "grpo"]
    spec.variants["broken"] = dataclasses.replace(spec.variants["grpo"], overrides={"actor.no_such_key": 1})
    # strict validation: GRPO does not read GAE's lambda, so the base's 0.95 left in place is refused
    spec.variants["grpo_lam"] = dataclasses.replace(spec.variants["grpo"], overrides={"algorithm.name": "grpo"})
    plan = build_plan(spec, base, tmp_path, variants=["sao", "broken", "grpo_lam"], seeds=1, warmup_seeds=1)
    assert set(plan.errors) == {"broken", "grpo_lam"} and "no_such_key" in plan.errors["broken"]
    assert "algorithm.gae.lam" in plan.errors["grpo_lam"]
    assert {r.variant for r in plan.runs} == {"sao"}
    with pytest.raises(ValueError, match="unknown"):
        select_variants(spec, full=False, only=["nope"])


def test_arms_differ_from_their_reference_only_where_they_say(tmp_path):
    """The primary GRPO arm takes SAO's one optimizer step per batch; the epochs arm is the only one
    with more; the staleness sweep changes only the staleness (and the room in flight for it)."""
    from sao_megatron.config import load_config

    spec, base = load_study(STUDY)
    plan = build_plan(spec, base, tmp_path, variants=FULL, seeds=1, warmup_seeds=1)
    cfgs = {r.variant: load_config(base, r.overrides) for r in plan.runs}
    steps = {v: c.actor.ppo_epochs * c.actor.num_minibatches for v, c in cfgs.items()}
    assert {v for v, n in steps.items() if n != 1} == {"grpo_epochs"} and steps["grpo_epochs"] == 8
    assert [cfgs[v].scheduler.max_staleness for v in ("sao", "sao_staleness2", "sao_staleness4")] == [1, 2, 4]
    for v, eta in (("sao_staleness2", 2), ("sao_staleness4", 4)):
        assert cfgs[v].scheduler.concurrency >= (eta + 1) * cfgs[v].scheduler.batch_size
        assert cfgs[v].algorithm == cfgs["sao"].algorithm and cfgs[v].critic == cfgs["sao"].critic
    assert cfgs["grpo"].algorithm.name == "grpo" and cfgs["grpo"].scheduler.batch_size == cfgs["sao"].scheduler.batch_size
    # claim 4: the three fast-and-stale arms share lr and staleness and differ from each other only in the loss
    fast = cfgs["sao_fast_stale"]
    assert (fast.actor.optimizer.lr, fast.scheduler.max_staleness) == (2.5 * cfgs["sao"].actor.optimizer.lr, 4)
    assert fast.algorithm == cfgs["sao"].algorithm and fast.critic == cfgs["sao"].critic
    no_mask, ppo = cfgs["sao_fast_stale_no_mask"], cfgs["ppo_fast_stale"]
    assert no_mask.algorithm.dis.eps_low == 1.0 and math.log1p(no_mask.algorithm.dis.eps_high) > 20  # never masks
    assert dataclasses.replace(no_mask.algorithm, dis=fast.algorithm.dis) == fast.algorithm
    assert ppo.algorithm.name == "ppo" and ppo.algorithm.gae == fast.algorithm.gae and ppo.critic == fast.critic
    for c in (no_mask, ppo):
        assert (c.actor, c.scheduler) == (fast.actor, fast.scheduler)
    assert all(c.eval.num_prompts == 512 and c.eval.before_train for c in cfgs.values())


def test_dry_run_lists_the_nested_design_and_every_variant(tmp_path, capsys):
    assert main(["study", "--config", STUDY, "--out", str(tmp_path), "--full", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "2 warm-up seeds x 4 RL seeds = 8 paired runs per arm" in out
    assert "warm-up w0: sao-megatron sft run.sft_steps=200 run.seed=1234" in out and "warm-up w1:" in out
    rows = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.split() and ln.split()[0] in FULL}
    assert sorted(rows) == sorted(FULL)
    assert rows["grpo_dis_equal_diversity_steps"][1:5] == ["32x8", "200", "51200", "8"]
    assert rows["grpo_dis_equal_diversity"][1:5] == ["32x8", "25", "6400", "8"]
    assert rows["sao_staleness4"][1:3] == ["32x1", "200"] and rows["grpo"][1:3] == ["4x8", "200"]
    assert "pairs (warm-up, RL seed): w0r0 w0r1 w0r2 w0r3 w1r0 w1r1 w1r2 w1r3" in out
    assert "estimated time:" in out
    assert not any(tmp_path.iterdir())  # nothing ran


def test_default_study_is_sao_against_the_primary_grpo_arm_over_all_pairs(tmp_path, capsys):
    assert main(["study", "--config", STUDY, "--out", str(tmp_path), "--dry-run", "--seeds", "2",
                 "--warmup-seeds", "3"]) == 0
    out = capsys.readouterr().out
    arms = [ln.split()[0] for ln in out.splitlines() if ln.split() and ln.split()[0] in FULL]
    assert arms == ["sao", "grpo"] and "3 warm-up seeds x 2 RL seeds = 6 paired runs per arm" in out


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
    # a phase that never recovers counts as its own length (here the last 8 of 20 steps), not the run's
    never = run_stats(_records([1.0] * 12 + [0.0] * 8, phases=[0] * 12 + [1] * 8), threshold=0.5, online=True)
    assert never["adaptation_steps"] == 8


def _fake_cli(tmp_path):
    """A stand-in for `sao-megatron sft|train`: sft writes an actor checkpoint's metadata.json (and fails
    for the seed named in FAIL_SFT); train checks it loads one and writes metrics from its run.seed,
    failing once on seed 2235."""
    script = tmp_path / "fake_cli.py"
    script.write_text(
        "import json, os, pathlib, sys\n"
        "a = sys.argv\n"
        "run = pathlib.Path(a[a.index('--run-dir') + 1]); run.mkdir(parents=True, exist_ok=True)\n"
        "sets = {a[i + 1].split('=', 1)[0]: a[i + 1].split('=', 1)[1] for i, x in enumerate(a) if x == '--set'}\n"
        "seed = int(sets['run.seed'])\n"
        "if a[1] == 'sft':\n"
        "    if str(seed) == os.environ.get('FAIL_SFT'): sys.exit(4)\n"
        "    (run / 'sft_actor').mkdir(); (run / 'sft_actor' / 'metadata.json').write_text('{}'); sys.exit(0)\n"
        "assert sets['run.sft_steps'] == '0' and (pathlib.Path(json.loads(sets['actor.load'])) / 'metadata.json').is_file()\n"
        "steps = int(sets['run.num_steps'])\n"
        "flag = run / 'tried'\n"
        "if seed == 2235 and not flag.exists():\n"
        "    flag.write_text(''); sys.exit(3)\n"
        "with (run / 'metrics.jsonl').open('w') as f:\n"
        "    for i in range(steps):\n"
        "        f.write(json.dumps({'step': i, 'reward/mean': (seed - 2234) * 0.5, 'eval/pass_at_1': (seed - 2234) * 0.5}) + '\\n')\n")
    return script


def _fake_commands(monkeypatch, fake):
    monkeypatch.setattr(runner, "train_command", lambda p, r: [sys.executable, str(fake), "train", "--run-dir",
                                                               str(r.run_dir)] + [x for s in r.overrides for x in ("--set", s)])
    monkeypatch.setattr(runner, "warmup_command", lambda p, w: [sys.executable, str(fake), "sft", "--run-dir",
                                                                str(w.run_dir)] + [x for s in w.overrides for x in ("--set", s)])


def test_execute_warms_up_first_is_resumable_and_tables_aggregate_over_pairs(tmp_path, monkeypatch):
    spec, base = load_study(STUDY)
    spec.samples_per_run = 64
    plan = build_plan(spec, base, tmp_path / "out", variants=["sao"], seeds=3, warmup_seeds=1)
    _fake_commands(monkeypatch, _fake_cli(tmp_path))
    events = []
    failed = runner.execute(plan, 2, on_event=events.append, poll_s=0.05)
    assert events[0].startswith("start warm-up w0") and events[1].startswith("done  warm-up w0")
    assert [r.seed_index for r in failed] == [1]
    assert [runner.is_done(r) for r in plan.runs] == [True, False, True] and runner.is_done(plan.warmups[0])
    assert runner.estimate_seconds(plan, 1) > 0
    started = []
    assert runner.execute(plan, 2, on_event=started.append, poll_s=0.05) == []
    assert [m.split(" ->")[0] for m in started if m.startswith("start")] == ["start sao w0 r1: 2 steps"]
    md, csv_path = write_tables(collect(plan), tmp_path, threshold=0.5)
    row = next(csv.DictReader(csv_path.open()))
    assert row["variant"] == "sao" and row["runs"] == "3"
    assert float(row["heldout_pass_at_1_mean"]) == pytest.approx(0.5)  # runs give 0, 0.5, 1.0
    assert float(row["heldout_pass_at_1_high"]) - 0.5 == pytest.approx(4.302652729911275 * 0.5 / math.sqrt(3))
    assert "| sao | 32x1 | 3 | 0.500 ± 1.242" in md.read_text()


def test_rl_runs_start_pair_by_pair_so_a_stopped_study_has_whole_pairs(tmp_path, monkeypatch):
    """The plan lists runs arm by arm; they start pair by pair, in the arms' order within a pair, and a
    run already done is not started again."""
    spec, base = load_study(STUDY)
    spec.samples_per_run = 64
    plan = build_plan(spec, base, tmp_path / "out", variants=["sao", "grpo"], seeds=3, warmup_seeds=1)
    assert [(r.variant, r.pair) for r in plan.runs][:2] == [("sao", (0, 0)), ("sao", (0, 1))]
    _fake_commands(monkeypatch, _fake_cli(tmp_path))
    (done := next(r for r in plan.runs if r.variant == "grpo" and r.pair == (0, 0))).run_dir.mkdir(parents=True)
    (done.run_dir / runner.DONE_FILE).write_text("{}")
    events = []
    runner.execute(plan, 1, on_event=events.append, poll_s=0.05)
    started = [m.split(":")[0] for m in events if m.startswith("start") and "warm-up" not in m]
    assert started == ["start sao w0 r0", "start sao w0 r1", "start grpo w0 r1", "start sao w0 r2",
                       "start grpo w0 r2"]


def test_a_finished_run_records_the_cpu_time_of_its_process_tree(tmp_path, monkeypatch):
    """study_done.json's cpu_s is the run's CPU, including a child process it waited for (the engine):
    at least what the two processes measured of themselves, and not the study's own."""
    spec, base = load_study(STUDY)
    spec.samples_per_run = 32
    plan = build_plan(spec, base, tmp_path / "out", variants=["sao"], seeds=1, warmup_seeds=1)
    burn = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
            "open(sys.argv[1], 'w').write(str(time.process_time()))\n")
    script = tmp_path / "burn_cli.py"
    script.write_text(
        "import json, pathlib, subprocess, sys\n"
        f"burn = {burn!r}\n"
        "run = pathlib.Path(sys.argv[sys.argv.index('--run-dir') + 1]); run.mkdir(parents=True, exist_ok=True)\n"
        "subprocess.run([sys.executable, '-c', burn, str(run / 'child_cpu')], check=True)\n"
        "if sys.argv[1] == 'sft':\n"
        "    (run / 'sft_actor').mkdir(); (run / 'sft_actor' / 'metadata.json').write_text('{}')\n"
        "else:\n"
        "    (run / 'metrics.jsonl').write_text(json.dumps({'step': 0, 'reward/mean': 0.0}) + '\\n')\n"
        "exec(burn.replace('sys.argv[1]', repr(str(run / 'own_cpu'))))\n")
    _fake_commands(monkeypatch, script)
    assert runner.execute(plan, 1, on_event=lambda m: None, poll_s=0.05) == []
    for item in (plan.warmups[0], plan.runs[0]):
        info = json.loads((item.run_dir / runner.DONE_FILE).read_text())
        own, child = (float((item.run_dir / f).read_text()) for f in ("own_cpu", "child_cpu"))
        assert own + child <= info["cpu_s"] < own + child + 5.0 and info["cpu_s"] <= 2 * info["wall_s"] + 0.1


def test_a_failed_warmup_fails_its_arms_without_starting_them(tmp_path, monkeypatch):
    spec, base = load_study(STUDY)
    spec.samples_per_run = 64
    plan = build_plan(spec, base, tmp_path / "out", variants=["sao", "grpo"], seeds=1, warmup_seeds=2)
    _fake_commands(monkeypatch, _fake_cli(tmp_path))
    monkeypatch.setenv("FAIL_SFT", "1235")  # warm-up w1
    events = []
    failed = runner.execute(plan, 1, on_event=events.append, poll_s=0.05)
    assert sorted((getattr(f, "variant", "warm-up"), f.run_dir.name) for f in failed) == [
        ("grpo", "w1r0"), ("sao", "w1r0"), ("warm-up", "w1")]
    assert not any("w1 r0" in m for m in events if m.startswith("start"))
    assert [r.pair for r in plan.runs if runner.is_done(r)] == [(0, 0), (0, 0)]


def test_paired_table_matches_runs_by_warmup_and_rl_seed():
    """Variant minus reference on the same (warm-up, RL seed) pair, against a hand recount; a pair only
    one side finished is left out. A shared per-warm-up offset cancels: the paired interval is narrow
    where the unpaired ones are wide."""
    from sao_megatron.algorithms.stats import t_interval
    from sao_megatron.study.summary import VariantRow, paired, paired_table

    warmup = {0: 0.8, 1: 0.01}  # the start each warm-up leaves; RL seed r adds its own offset
    start = {(w, r): warmup[w] + 0.03 * r for w in (0, 1) for r in (0, 1, 2)}
    ref_pairs = [(0, 0), (0, 1), (1, 0), (1, 1)]
    other_pairs = [(1, 1), (0, 0), (1, 0), (0, 1), (0, 2)]  # (0, 2): the reference did not finish it
    ref = VariantRow("sao", "32x1", "", seeds=ref_pairs,
                     runs=[{"heldout_pass_at_1": start[p] + 0.02} for p in ref_pairs])
    other = VariantRow("grpo", "4x8", "", seeds=other_pairs,
                       runs=[{"heldout_pass_at_1": start[p] - 0.05 + 0.01 * p[1]} for p in other_pairs])
    # a slow recount: match every pair by hand (same warm-up AND same RL seed)
    diffs = [o["heldout_pass_at_1"] - r["heldout_pass_at_1"]
             for po, o in zip(other_pairs, other.runs) for pr, r in zip(ref_pairs, ref.runs) if po == pr]
    mean, low, high, n = paired(other, ref, "heldout_pass_at_1")
    assert n == 4 and (mean, low, high) == pytest.approx(t_interval(diffs))
    assert high < 0  # the pairs support "grpo is lower"
    assert ref.agg("heldout_pass_at_1")[2] - ref.agg("heldout_pass_at_1")[1] > 10 * (high - low)
    table = "\n".join(paired_table([ref, other]))
    assert "| grpo | 4 | " + f"{mean:.3f} ± {(high - low) / 2:.3f}" in table
    assert "adaptation" not in table  # no online pair: no column of n/a
    assert paired_table([ref]) == []


def test_paired_table_compares_adaptation_between_online_arms():
    """Online arms against an online reference: the steps to recover after each shift, pair by pair."""
    from sao_megatron.algorithms.stats import t_interval
    from sao_megatron.study.summary import VariantRow, paired_table

    pairs = [(0, 0), (0, 1), (1, 0), (1, 1)]
    ref = VariantRow("sao_online", "32x1", "", seeds=pairs,
                     runs=[{"heldout_pass_at_1": 0.7, "adaptation_steps": 10.0 + w + r} for w, r in pairs])
    other = VariantRow("grpo_online", "4x8", "", seeds=pairs[::-1],
                       runs=[{"heldout_pass_at_1": 0.7, "adaptation_steps": 14.0 + 3 * w + r} for w, r in pairs[::-1]])
    mean, low, high = t_interval([4.0 + 2 * w for w, _ in pairs])
    lines = paired_table([ref, other])
    assert "Δ adaptation steps" in lines[3]
    assert lines[-1].endswith(f"| {mean:.1f} ± {(high - low) / 2:.1f} |")


def test_heldout_curve_starts_at_the_starting_weights():
    from sao_megatron.study.summary import _curve

    recs = _records([0.1] * 20, evals={9: 0.3, 19: 0.4})
    assert _curve(recs, "eval/pass_at_1") == ([9, 19], [0.3, 0.4])
    recs[0]["eval_start/pass_at_1"] = 0.2
    assert _curve(recs, "eval/pass_at_1") == ([-1, 9, 19], [0.2, 0.3, 0.4])  # drawn at 0 trained samples
    assert _curve(recs, "reward/mean")[0] == list(range(20))


def test_step_size_columns_by_hand():
    """Advantage RMS from the logged mean and population std (checked against the tokens themselves),
    grad and update norms as run means (and the largest grad norm), staleness, PPO's clip fraction and
    the k3 KL to the rollout policy as run means of the per-step values; NaN where a run logs none."""
    import torch

    from sao_megatron.algorithms.metrics import advantage_stats

    steps = [torch.tensor([[0.5, -1.0, 2.0]]), torch.tensor([[0.1, 0.1, -0.3]])]
    recs = []
    for i, adv in enumerate(steps):
        stats = {k: float(v) for k, v in advantage_stats(adv, torch.ones_like(adv)).items()}
        recs.append({"step": i, "reward/mean": 0.1, **stats, "actor/grad_norm": 3.0 - 2 * i,
                     "actor/update_norm": 0.01 * (i + 1), "train/staleness_mean": 0.5 * i,
                     "actor/clip_frac": 0.1 * i, "actor/kl_k3": 0.002 + 0.004 * i})
    s = run_stats(recs, threshold=0.5, online=False)
    rms = [float(adv.pow(2).mean().sqrt()) for adv in steps]
    assert s["advantage_rms"] == pytest.approx(sum(rms) / 2)
    assert s["grad_norm"] == pytest.approx(2.0) and s["grad_norm_max"] == 3.0
    assert s["update_norm"] == pytest.approx(0.015)
    assert s["staleness"] == pytest.approx(0.25)
    assert s["clip_frac"] == pytest.approx(0.05) and s["kl_k3"] == pytest.approx(0.004)
    bare = run_stats(_records([0.1, 0.2]), threshold=0.5, online=False)
    assert all(math.isnan(bare[k]) for k in ("update_norm", "grad_norm_max", "clip_frac", "kl_k3"))
    assert math.isnan(bare["reward_low"])  # 2 steps: no full window


def test_lowest_training_reward_is_the_worst_full_window_by_hand():
    """The lowest trailing mean over SMOOTH_STEPS (10) steps, full windows only: a recount by slices."""
    rewards = [0.5] * 12 + [0.0, 0.1, 0.0] + [0.9] * 20 + [0.2] * 3
    by_hand = min(sum(rewards[i:i + 10]) / 10 for i in range(len(rewards) - 9))
    low = run_stats(_records(rewards), threshold=0.5, online=False)["reward_low"]
    assert low == pytest.approx(by_hand) and low == pytest.approx(0.36)  # steps 5..14: (7 x 0.5 + 0.1) / 10


def test_an_archived_study_continues_on_another_machine(tmp_path, monkeypatch, capsys):
    """--archive keeps each finished run and warm-up; a study in another directory (another machine)
    restores the ones that match its plan instead of running them, and its tables come out the same.
    A record measured with another configuration is not restored: that run runs again."""
    _fake_commands(monkeypatch, _fake_cli(tmp_path))
    store = tmp_path / "archive"
    args = ["study", "--config", STUDY, "--variants", "sao", "--seeds", "2", "--warmup-seeds", "1",
            "--archive", str(store)]
    main(args + ["--out", str(tmp_path / "a")])  # r1 fails once (the fake CLI)
    main(args + ["--out", str(tmp_path / "a")])
    assert sorted(p.name for p in (store / "runs" / "sao").iterdir()) == ["w0r0.json.gz", "w0r1.json.gz"]
    assert (store / "warmups" / "w0.tar.gz").is_file()
    first = (tmp_path / "a" / "results.csv").read_text()

    monkeypatch.setattr(runner, "train_command", lambda p, r: [sys.executable, "-c", "raise SystemExit(9)"])
    monkeypatch.setattr(runner, "warmup_command", lambda p, w: [sys.executable, "-c", "raise SystemExit(9)"])
    capsys.readouterr()
    assert main(args + ["--out", str(tmp_path / "b")]) == 0  # nothing runs: every item restored
    out = capsys.readouterr().out
    assert "restored 1 warm-up(s) and 2 run(s)" in out and "start " not in out
    assert (tmp_path / "b" / "results.csv").read_text() == first
    assert (tmp_path / "b" / "warmup" / "w0" / "sft_actor" / "metadata.json").is_file()

    # another configuration (a different learning rate for every arm): nothing matches, everything runs
    changed = tmp_path / "changed.yaml"
    changed.write_text(open(STUDY).read().replace("actor.optimizer.lr: 2.0e-4", "actor.optimizer.lr: 3.0e-4")
                       .replace("base: ../experiments/", f"base: {pathlib.Path(STUDY).resolve().parent.parent}/experiments/"))
    capsys.readouterr()
    assert main([a if a != STUDY else str(changed) for a in args] + ["--out", str(tmp_path / "c")]) == 1
    out = capsys.readouterr().out
    assert "restored 0 warm-up(s) and 0 run(s)" in out and "FAILED warm-up w0" in out


def test_plot_curves_by_samples_and_by_steps(tmp_path):
    """Each arm's mean curve over its runs, against RL steps and against steps x its own batch, cut to
    its shortest run; a 256-sample arm reaches SAO's 200-step sample count in 25 steps."""
    from types import SimpleNamespace

    from sao_megatron.study.spec import PlannedRun
    from sao_megatron.study.summary import mean_curves, write_plots

    def run(variant, r, batch, rewards, start):
        d = tmp_path / variant / f"r{r}"
        d.mkdir(parents=True)
        recs = _records(rewards, evals={len(rewards) - 1: rewards[-1]})
        recs[0]["eval_start/pass_at_1"] = start
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))
        return PlannedRun(variant, 0, r, d, [], len(rewards), batch, 1, False)

    runs = [run("sao", 0, 32, [0.1, 0.3, 0.5, 0.7], 0.2), run("sao", 1, 32, [0.3, 0.5, 0.7, 0.9], 0.4),
            run("wide", 0, 256, [0.2, 0.6, 0.4], 0.1)]
    plan = SimpleNamespace(runs=runs)
    reward = mean_curves(plan, "reward/mean")
    assert reward["sao"][:2] == ([1, 2, 3, 4], [32, 64, 96, 128])
    assert reward["sao"][2] == pytest.approx([0.2, 0.4, 0.6, 0.8]) and reward["sao"][3] == 2
    assert reward["wide"][:3] == ([1, 2, 3], [256, 512, 768], [0.2, 0.6, 0.4])
    held = mean_curves(plan, "eval/pass_at_1")
    assert held["sao"][:2] == ([0, 4], [0, 128]) and held["sao"][2] == pytest.approx([0.3, 0.8])
    assert held["wide"][:3] == ([0, 3], [0, 768], [0.1, 0.4])
    assert [p.name for p in write_plots(plan, tmp_path / "plots")] == ["training_reward.png", "heldout_pass_at_1.png"]
