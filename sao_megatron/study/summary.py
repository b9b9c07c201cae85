"""Tables and plots of a study: one row per arm, mean and 95 % CI over its runs (warm-up x RL seeds).

Per run (from its ``metrics.jsonl``): held-out pass@1 of the last evaluation, final training reward
(mean ``reward/mean`` over the last 10 % of steps), steps to the study's reward threshold, entropy
collapse (``actor/entropy`` over the last 10 % / first 10 % of steps), DIS masked fractions (run
mean), critic explained variance (last 20 %), the step sizes (run means of the per-token advantage
RMS ``sqrt(advantages/mean² + advantages/std²)``, of ``actor/grad_norm`` before clipping and of
``actor/update_norm``, the parameter change of a batch's optimizer steps), staleness (run mean of
``train/staleness_mean``), and for online runs the steps after each phase change until the trailing
reward is back at 90 % of the highest level an earlier phase ended at; the gains during RL (held-out pass@1 of the last minus the
first evaluation, or of the starting weights with ``eval.before_train``; training reward of the last
minus the first 10 % of steps). Per variant: mean
with a Student-t 95 % CI over runs.

Run (w, r) of every arm starts from warm-up w's actor with RL seed r, and the warm-up's spread over
seeds can dwarf what RL changes. So the second table compares each arm with the first one (the
reference) pair by pair: the CI of the paired differences, which the warm-up's spread cancels out of.
"""

from __future__ import annotations

import csv
import math
import pathlib
from dataclasses import dataclass, field

from sao_megatron.study.spec import Plan, PlannedRun
from sao_megatron.algorithms.stats import adaptation_steps, phase_changes, steps_to_threshold, t_interval, trailing_mean

RUN_KEYS = ("heldout_pass_at_1", "heldout_gain", "final_reward", "reward_gain", "steps_to_threshold",
            "entropy_ratio", "dis_masked_low", "dis_masked_high", "critic_explained_var", "adaptation_steps",
            "advantage_rms", "grad_norm", "grad_norm_max", "update_norm", "staleness", "clip_frac", "kl_k3",
            "reward_low")

SMOOTH_STEPS = 10
"""The training reward is smoothed as the trailing mean over this many steps (the plots, and the lowest
training reward of a run): one step's 32 samples score with a standard error of about 0.08, which
hides the differences between arms."""


def _read(run_dir: pathlib.Path) -> list[dict]:
    from sao_megatron.training.run.metrics_log import read_metrics

    return read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], float(r[key])) for r in records
           if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])]
    return [s for s, _ in pts], [v for _, v in pts]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def _tail(xs: list[float], frac: float) -> list[float]:
    return xs[-max(1, int(len(xs) * frac)):] if xs else []


def run_stats(records: list[dict], *, threshold: float, online: bool) -> dict[str, float]:
    """The per-run numbers of the table (NaN where a run has no such metric)."""
    steps, reward = _series(records, "reward/mean")
    _, evals = _series(records, "eval/pass_at_1")
    _, heldout = _curve(records, "eval/pass_at_1")  # the starting weights first with eval.before_train
    _, entropy = _series(records, "actor/entropy")
    _, grad = _series(records, "actor/grad_norm")
    hit = steps_to_threshold(steps, reward, threshold)
    head = reward[:max(1, len(reward) // 10)]
    out = {"heldout_pass_at_1": evals[-1] if evals else math.nan,
           "heldout_gain": heldout[-1] - heldout[0] if evals and len(heldout) >= 2 else math.nan,
           "final_reward": _mean(_tail(reward, 0.1)),
           "reward_gain": _mean(_tail(reward, 0.1)) - _mean(head) if reward else math.nan,
           "steps_to_threshold": math.nan if hit is None else float(hit + 1),
           "entropy_ratio": _mean(_tail(entropy, 0.1)) / _mean(entropy[:max(1, len(entropy) // 10)])
           if entropy else math.nan,
           "dis_masked_low": _mean(_series(records, "actor/dis_masked_low_frac")[1]),
           "dis_masked_high": _mean(_series(records, "actor/dis_masked_high_frac")[1]),
           "critic_explained_var": _mean(_tail(_series(records, "critic/explained_var")[1], 0.2)),
           "adaptation_steps": math.nan,
           "advantage_rms": advantage_rms(records),
           "grad_norm": _mean(grad),
           "grad_norm_max": max(grad, default=math.nan),
           "update_norm": _mean(_series(records, "actor/update_norm")[1]),
           "staleness": _mean(_series(records, "train/staleness_mean")[1]),
           "clip_frac": _mean(_series(records, "actor/clip_frac")[1]),
           "kl_k3": _mean(_series(records, "actor/kl_k3")[1]),
           # the worst stretch: the lowest trailing mean over SMOOTH_STEPS steps (full windows only)
           "reward_low": min(trailing_mean(reward, SMOOTH_STEPS)[SMOOTH_STEPS - 1:], default=math.nan)}
    if online:
        phases = [int(r.get("rollout/phase", 0)) for r in records if isinstance(r.get("reward/mean"), (int, float))]
        if len(phases) == len(reward):
            adapt = adaptation_steps(steps, reward, phases)
            # A phase that never recovers counts as its own length (a lower bound on its true cost).
            vals = [a if a is not None else steps[end - 1] - steps[c] + 1
                    for a, (c, end) in zip(adapt, phase_changes(phases))]
            out["adaptation_steps"] = _mean([float(v) for v in vals])
    return out


def advantage_rms(records: list[dict]) -> float:
    """Run mean of the per-step RMS of the token advantages, from their logged mean and population std."""
    rms = [math.sqrt(r["advantages/mean"] ** 2 + r["advantages/std"] ** 2) for r in records
           if isinstance(r.get("advantages/mean"), (int, float)) and isinstance(r.get("advantages/std"), (int, float))]
    return _mean(rms)


@dataclass(slots=True)
class VariantRow:
    variant: str
    shape: str
    describe: str
    runs: list[dict[str, float]] = field(default_factory=list)
    seeds: list[tuple[int, int]] = field(default_factory=list)
    """The (warm-up seed, RL seed) pair of each of ``runs``: what the paired table matches on."""

    def agg(self, key: str) -> tuple[float, float, float, int]:
        """(mean, ci_low, ci_high, n) over the runs that have the metric."""
        vals = [r[key] for r in self.runs if not math.isnan(r[key])]
        return (*t_interval(vals), len(vals))


def collect(plan: Plan) -> list[VariantRow]:
    """One row per variant over its finished runs (an unfinished run's 'final' numbers are not final)."""
    from sao_megatron.study.runner import is_done

    rows: dict[str, VariantRow] = {}
    for run in plan.runs:
        row = rows.setdefault(run.variant, VariantRow(run.variant, shape_of(run), plan.spec.variants[run.variant].describe))
        records = _read(run.run_dir) if is_done(run) else []
        if records:
            row.runs.append(run_stats(records, threshold=plan.spec.threshold, online=run.online))
            row.seeds.append(run.pair)
    return list(rows.values())


def shape_of(run: PlannedRun) -> str:
    """prompts x rollouts per step."""
    return f"{run.batch_size // run.group_size}x{run.group_size}"


def _fmt(mean: float, low: float, high: float, n: int, digits: int = 3) -> str:
    if n == 0 or math.isnan(mean):
        return "n/a"
    if n == 1:
        return f"{mean:.{digits}f} (1 run)"
    return f"{mean:.{digits}f} ± {(high - low) / 2:.{digits}f}"


_COLUMNS = (("held-out pass@1", "heldout_pass_at_1"), ("held-out gain", "heldout_gain"),
            ("final train reward", "final_reward"), ("train reward gain", "reward_gain"),
            ("steps to threshold", "steps_to_threshold"), ("entropy last/first", "entropy_ratio"),
            ("DIS masked low", "dis_masked_low"), ("DIS masked high", "dis_masked_high"),
            ("critic expl. var", "critic_explained_var"), ("adaptation steps", "adaptation_steps"),
            ("advantage RMS", "advantage_rms"), ("grad norm", "grad_norm"), ("grad norm max", "grad_norm_max"),
            ("update norm", "update_norm"), ("staleness", "staleness"), ("PPO clip frac", "clip_frac"),
            ("KL to rollout (k3)", "kl_k3"), ("lowest train reward", "reward_low"))


def write_tables(rows: list[VariantRow], out: pathlib.Path, *, threshold: float) -> tuple[pathlib.Path, pathlib.Path]:
    """results.md (mean ± 95 % CI half-width over runs) and results.csv (mean, low, high, n)."""
    head = "| variant | prompts x rollouts | runs | " + " | ".join(c for c, _ in _COLUMNS) + " |"
    lines = [f"Mean ± 95 % CI half-width over runs (warm-up x RL seeds, Student t). Threshold for 'steps to "
             f"threshold': training reward {threshold:g}. n/a: no finished run has the metric.", "", head,
             "|" + "---|" * (3 + len(_COLUMNS))]
    for row in rows:
        cells = [_fmt(*row.agg(k), digits=1 if k in ("steps_to_threshold", "adaptation_steps")
                      else 4 if k in ("update_norm", "kl_k3") else 3)
                 for _, k in _COLUMNS]
        lines.append(f"| {row.variant} | {row.shape} | {len(row.runs)} | " + " | ".join(cells) + " |")
    lines += paired_table(rows)
    md = out / "results.md"
    md.write_text("\n".join(lines) + "\n")
    path = out / "results.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "shape", "runs"] + [f"{k}_{s}" for _, k in _COLUMNS for s in ("mean", "low", "high", "n")])
        for row in rows:
            w.writerow([row.variant, row.shape, len(row.runs)] + [v for _, k in _COLUMNS for v in row.agg(k)])
    if len(rows) >= 2:  # results_paired.csv: the paired table's numbers (mean, low, high, pairs)
        with (out / "results_paired.csv").open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["variant", "reference"] + [f"delta_{k}_{s}" for _, k in _PAIRED for s in ("mean", "low", "high", "n")])
            for row in rows[1:]:
                w.writerow([row.variant, rows[0].variant] + [v for _, k in _PAIRED for v in paired(row, rows[0], k)])
    return md, path


_PAIRED = (("Δ held-out pass@1", "heldout_pass_at_1"), ("Δ held-out gain", "heldout_gain"),
           ("Δ final train reward", "final_reward"), ("Δ train reward gain", "reward_gain"),
           ("Δ lowest train reward", "reward_low"), ("Δ adaptation steps", "adaptation_steps"))
_ONLINE_ONLY = ("adaptation_steps",)
"""Paired columns shown in results.md only when some pair has them (online arms against an online reference)."""


def paired(row: VariantRow, ref: VariantRow, key: str) -> tuple[float, float, float, int]:
    """(mean, ci_low, ci_high, n) of ``row - ref`` over the (warm-up, RL seed) pairs both have the metric for."""
    mine = {s: r.get(key, math.nan) for s, r in zip(row.seeds, row.runs)}
    theirs = {s: r.get(key, math.nan) for s, r in zip(ref.seeds, ref.runs)}
    diffs = [mine[s] - theirs[s] for s in sorted(mine.keys() & theirs.keys())
             if not (math.isnan(mine[s]) or math.isnan(theirs[s]))]
    return (*t_interval(diffs), len(diffs))


def paired_table(rows: list[VariantRow]) -> list[str]:
    """Markdown lines: each arm minus the first one, pair by pair (empty with one arm)."""
    if len(rows) < 2:
        return []
    ref = rows[0]
    columns = [(c, k) for c, k in _PAIRED
               if k not in _ONLINE_ONLY or any(paired(row, ref, k)[3] for row in rows[1:])]
    lines = ["", f"Paired against `{ref.variant}` (variant minus {ref.variant} on the same warm-up and RL seed, mean "
             "± 95 % CI half-width; an interval that excludes 0 is a difference the pairs support).", "",
             "| variant | pairs | " + " | ".join(c for c, _ in columns) + " |", "|" + "---|" * (2 + len(columns))]
    for row in rows[1:]:
        cells = [paired(row, ref, k) + (k,) for _, k in columns]
        lines.append(f"| {row.variant} | {max(c[3] for c in cells)} | "
                     + " | ".join(_fmt(*c[:4], digits=1 if c[4] == "adaptation_steps" else 3) for c in cells) + " |")
    return lines


def _curve(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """``key`` against step; held-out pass@1 starts with the starting weights' score (eval.before_train)
    at step -1, i.e. 0 trained samples."""
    steps, values = _series(records, key)
    if key == "eval/pass_at_1":
        _, start = _series(records, "eval_start/pass_at_1")
        if start:
            return [-1, *steps], [start[0], *values]
    return steps, values


def mean_curves(plan: Plan, key: str) -> dict[str, tuple[list[int], list[int], list[float], int]]:
    """Per variant: ``key``'s mean over its runs, against RL steps taken and against trained samples
    (steps x the arm's batch), cut to its shortest run; and how many runs it averages. A point at
    step -1 (the starting weights' held-out score) is drawn at 0 steps and 0 samples."""
    out = {}
    for variant in dict.fromkeys(r.variant for r in plan.runs):
        runs = [r for r in plan.runs if r.variant == variant]
        curves = [(c, r.batch_size) for c, r in ((_curve(_read(r.run_dir), key), r) for r in runs) if c[1]]
        if not curves:
            continue
        n = min(len(ys) for (_, ys), _ in curves)
        (xs, _), batch = curves[0]
        mean = [sum(ys[i] for (_, ys), _ in curves) / len(curves) for i in range(n)]
        out[variant] = ([s + 1 for s in xs[:n]], [(s + 1) * batch for s in xs[:n]], mean, len(curves))
    return out


def write_plots(plan: Plan, out: pathlib.Path) -> list[pathlib.Path]:
    """Training reward and held-out pass@1, mean over seeds per variant, each against trained samples
    (sample efficiency; a log axis past one batch, since the equal-steps control trains on 8x the samples
    of the others) beside the same curves against RL steps (step efficiency)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    smallest_batch = min((r.batch_size for r in plan.runs), default=1)
    colors = plt.get_cmap("tab20").colors  # 18 arms in the full matrix: tab10 would repeat its colours
    for key, name, ylabel, window in (("reward/mean", "training_reward.png", "training reward", SMOOTH_STEPS),
                                      ("eval/pass_at_1", "heldout_pass_at_1.png", "held-out pass@1", 1)):
        fig, (by_samples, by_steps) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
        axis = f"{ylabel} (trailing mean of {window} steps)" if window > 1 else ylabel
        for i, (variant, (steps, samples, mean, runs)) in enumerate(mean_curves(plan, key).items()):
            mean = trailing_mean(mean, window)
            style = dict(color=colors[(2 * i) % 20 + (i // 10) % 2], linestyle="-" if i < 10 else "--",
                         label=f"{variant} ({runs} seeds)", marker="o" if len(mean) <= 12 else None, markersize=4)
            by_samples.plot(samples, mean, **style)
            by_steps.plot(steps, mean, **style)
        by_samples.set_xscale("symlog", linthresh=smallest_batch)
        by_samples.set(xlabel="trained samples (log past one batch)", ylabel=axis,
                       title=f"{ylabel} against samples (mean over seeds)")
        by_steps.set(xlabel="RL steps (batches trained on)", title=f"{ylabel} against steps")
        if by_steps.lines:
            by_steps.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the curves
        fig.tight_layout()
        fig.savefig(out / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(out / name)
    return written
