"""`sao-megatron study --config configs/studies/paper-miniature.yaml --out DIR [--seeds N] [--jobs J]
[--dry-run] [--full] [--variants a,b]`: the paper's comparisons in miniature, with seeds and CIs.

Prints the plan (variant, prompts x rollouts per step, steps, seeds) and the estimated time first;
``--dry-run`` stops there. Then runs every unfinished variant x seed (resumable: run the same
command again to continue) and writes ``DIR/results.md``, ``DIR/results.csv`` and ``DIR/plots/``.
``--summarize`` only rewrites the tables and plots from the runs on disk.
"""

from __future__ import annotations

import argparse
import pathlib
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("study", help="a matrix of variants x seeds at an equal sample budget (tables, CIs, plots)")
    p.add_argument("--config", required=True, help="study YAML (configs/studies/paper-miniature.yaml)")
    p.add_argument("--out", required=True, help="study directory (one subdirectory per run; resumable)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per variant (default: the study file's)")
    p.add_argument("--jobs", type=int, default=None, help="runs in parallel (default: the study file's)")
    p.add_argument("--full", action="store_true", help="the whole matrix instead of the default variants")
    p.add_argument("--variants", default=None, help="comma-separated variants to run instead")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the time estimate, run nothing")
    p.add_argument("--summarize", action="store_true", help="only write tables and plots from finished runs")
    p.set_defaults(func=_run)


def format_plan(plan, jobs: int, estimate_s: float) -> str:
    from sao_megatron.study.runner import is_done
    from sao_megatron.study.summary import shape_of

    lines = [f"study: base {plan.base_path}, {plan.spec.samples_per_run} trained samples per run, "
             f"{len(plan.runs)} runs, {jobs} in parallel",
             f"{'variant':<24} {'prompts x rollouts':>18} {'steps':>6} {'seeds':>5} {'done':>5}  description"]
    for name in dict.fromkeys(r.variant for r in plan.runs):
        runs = [r for r in plan.runs if r.variant == name]
        lines.append(f"{name:<24} {shape_of(runs[0]):>18} {runs[0].num_steps:>6} {len(runs):>5} "
                     f"{sum(is_done(r) for r in runs):>5}  {plan.spec.variants[name].describe}")
    for name, err in plan.errors.items():
        lines.append(f"{name:<24} {'not runnable':>18}  {err}")
    lines.append(f"estimated time: {estimate_s / 60:.0f} min for the unfinished runs")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    from sao_megatron.study.runner import estimate_seconds, execute
    from sao_megatron.study.spec import build_plan, load_study, select_variants, with_seeds
    from sao_megatron.study.summary import collect, write_plots, write_tables

    spec, base = load_study(args.config)
    spec = with_seeds(spec, args.seeds, args.jobs)
    if min(spec.seeds, spec.jobs) < 1:
        raise ValueError("--seeds and --jobs must be >= 1")
    only = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else None
    out = pathlib.Path(args.out)
    plan = build_plan(spec, base, out, variants=select_variants(spec, full=args.full, only=only), seeds=spec.seeds)
    sys.stdout.write(format_plan(plan, spec.jobs, estimate_seconds(plan, spec.jobs)) + "\n")
    if plan.errors and not (args.dry_run or args.summarize):
        raise ValueError(f"variant(s) {sorted(plan.errors)} do not load with this version of sao-megatron (see "
                         "above); run the others with --variants")
    if args.dry_run:
        return 0
    failed = [] if args.summarize else execute(plan, spec.jobs, on_event=lambda m: sys.stdout.write(m + "\n"))
    out.mkdir(parents=True, exist_ok=True)
    md, csv_path = write_tables(collect(plan), out, threshold=spec.threshold)
    plots = write_plots(plan, out / "plots")
    sys.stdout.write(md.read_text() + f"\n{md}\n{csv_path}\n" + "".join(f"{p}\n" for p in plots))
    if failed:
        sys.stdout.write(f"{len(failed)} run(s) failed (their train.log says why); run the same command again "
                         "to retry them\n")
    return 1 if failed else 0
