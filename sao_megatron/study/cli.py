"""`sao-megatron study --config configs/studies/paper-miniature.yaml --out DIR [--seeds R] [--warmup-seeds W]
[--jobs J] [--dry-run] [--full] [--variants a,b] [--archive A]`: the paper's comparisons in miniature, with
seeds and CIs.

Prints the plan first: the W shared warm-ups, then per arm its prompts x rollouts per step, steps,
and its W x R runs (warm-up seed x RL seed), and the estimated time; ``--dry-run`` stops there.
Then runs every unfinished warm-up and run (resumable: run the same command again to continue) and
writes ``DIR/results.md``, ``DIR/results.csv`` and ``DIR/plots/``.
``--summarize`` only rewrites the tables and plots from the runs on disk. ``--archive A`` first restores
the runs and warm-ups archived in A that match the plan, and archives each one that finishes
(``study/archive.py``): a study too long for one machine session continues on another.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("study", help="a matrix of variants x seeds at an equal sample budget (tables, CIs, plots)")
    p.add_argument("--config", required=True, help="study YAML (configs/studies/paper-miniature.yaml)")
    p.add_argument("--out", required=True, help="study directory (one subdirectory per run; resumable)")
    p.add_argument("--seeds", type=int, default=None, help="RL seeds R per warm-up and arm (default: the study file's)")
    p.add_argument("--warmup-seeds", type=int, default=None, help="warm-up seeds W (default: the study file's)")
    p.add_argument("--jobs", type=int, default=None, help="runs in parallel (default: the study file's)")
    p.add_argument("--full", action="store_true", help="the whole matrix instead of the default variants")
    p.add_argument("--variants", default=None, help="comma-separated variants to run instead")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the time estimate, run nothing")
    p.add_argument("--summarize", action="store_true", help="only write tables and plots from finished runs")
    p.add_argument("--archive", default=None,
                   help="directory of archived runs: restore the ones that match the plan, archive each "
                        "run and warm-up as it finishes (continue a study on another machine)")
    p.set_defaults(func=_run)


def format_plan(plan, jobs: int, estimate_s: float) -> str:
    from sao_megatron.study.runner import is_done, measured_run_cost
    from sao_megatron.study.summary import shape_of

    spec, w, r = plan.spec, len(plan.warmups), spec_rl_seeds(plan)
    lines = [f"study: base {plan.base_path}, {spec.samples_per_run} trained samples per run (unless equal steps)",
             f"nested design: {w} warm-up seeds x {r} RL seeds = {w * r} paired runs per arm; "
             f"{len(plan.warmups)} warm-ups + {len(plan.runs)} RL runs, {jobs} in parallel"]
    for wu in plan.warmups:
        lines.append(f"  warm-up w{wu.index}: sao-megatron sft {' '.join(_warmup_sets(plan, wu))} -> {wu.actor}"
                     f"{' (done)' if is_done(wu) else ''}")
    lines.append("  every arm: --set actor.load=<warm-up actor> run.sft_steps=0 (weights only: a fresh optimizer)")
    lines.append(f"{"arm":<31} {'prompts x rollouts':>18} {'steps':>6} {'samples':>7} {'runs':>4} {'done':>4}  "
                 "description")
    for name in dict.fromkeys(x.variant for x in plan.runs):
        runs = [x for x in plan.runs if x.variant == name]
        lines.append(f"{name:<31} {shape_of(runs[0]):>18} {runs[0].num_steps:>6} "
                     f"{runs[0].num_steps * runs[0].batch_size:>7} {len(runs):>4} {sum(is_done(x) for x in runs):>4}  "
                     f"{spec.variants[name].describe}")
    for name, err in plan.errors.items():
        lines.append(f"{name:<31} {'not runnable':>18}  {err}")
    pairs = sorted({x.pair for x in plan.runs})
    lines.append(f"pairs (warm-up, RL seed): {' '.join(f'w{a}r{b}' for a, b in pairs)}")
    done, wall, cpu = measured_run_cost(plan)
    if done:
        # NaN: every finished run predates the CPU record
        cpu_text = "CPU not recorded" if math.isnan(cpu) else f"{cpu:.0f} s CPU"
        lines.append(f"measured: {done} finished RL run(s), per run {wall:.0f} s wall, {cpu_text} (mean)")
    lines.append(f"estimated time: {estimate_s / 60:.0f} min for the unfinished runs")
    return "\n".join(lines)


def spec_rl_seeds(plan) -> int:
    return len({x.seed_index for x in plan.runs}) or plan.spec.rl_seeds


def _warmup_sets(plan, wu) -> list[str]:
    """The warm-up's own --set list (its overrides and seed), without the study's common ones."""
    from sao_megatron.study.spec import to_sets

    common = set(to_sets(plan.spec.common))
    return [s for s in wu.overrides if s not in common]


def _run(args: argparse.Namespace) -> int:
    from sao_megatron.study.runner import estimate_seconds, execute
    from sao_megatron.study.spec import build_plan, load_study, select_variants, with_seeds
    from sao_megatron.study.summary import collect, write_plots, write_tables

    spec, base = load_study(args.config)
    for flag, value in (("--seeds", args.seeds), ("--warmup-seeds", args.warmup_seeds), ("--jobs", args.jobs)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1")
    spec = with_seeds(spec, args.seeds, args.jobs, args.warmup_seeds)
    only = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else None
    out = pathlib.Path(args.out)
    plan = build_plan(spec, base, out, variants=select_variants(spec, full=args.full, only=only))
    on_done = None
    if args.archive:
        from sao_megatron.study import archive
        from sao_megatron.study.runner import DONE_FILE
        from sao_megatron.study.spec import PlannedRun

        store = pathlib.Path(args.archive)
        warmups, runs = archive.restore(plan, store, DONE_FILE)
        added = archive.backfill(plan, store, DONE_FILE)
        sys.stdout.write(f"archive {store}: restored {warmups} warm-up(s) and {runs} run(s); archived {added} "
                         "finished here before\n")

        def on_done(item, done):
            if isinstance(item, PlannedRun):
                archive.save_run(plan, item, store, done)
            else:
                archive.save_warmup(plan, item, store)
    sys.stdout.write(format_plan(plan, spec.jobs, estimate_seconds(plan, spec.jobs)) + "\n")
    if plan.errors and not (args.dry_run or args.summarize):
        raise ValueError(f"variant(s) {sorted(plan.errors)} do not load with this version of sao-megatron (see "
                         "above); run the others with --variants")
    if args.dry_run:
        return 0
    failed = [] if args.summarize else execute(plan, spec.jobs, on_event=lambda m: sys.stdout.write(m + "\n"),
                                               on_done=on_done)
    out.mkdir(parents=True, exist_ok=True)
    md, csv_path = write_tables(collect(plan), out, threshold=spec.threshold)
    plots = write_plots(plan, out / "plots")
    sys.stdout.write(md.read_text() + f"\n{md}\n{csv_path}\n" + "".join(f"{p}\n" for p in plots))
    if failed:
        sys.stdout.write(f"{len(failed)} run(s) failed (their train.log says why); run the same command again "
                         "to retry them\n")
    return 1 if failed else 0
