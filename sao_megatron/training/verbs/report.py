"""`sao-megatron report RUN_DIR`: PNG plots from a run's metrics.jsonl.

Plots: reward curve (with a moving average), staleness histogram over the
whole run, DIS masked-token fractions, critic explained variance, held-out
evaluation (pass@1 with its 95 % Wilson interval, mean reward) when the run has ``eval/*`` metrics and, for
non-stationary runs, reward per phase against steps since the phase began
(adaptation speed), and the stale-drop rate per response-length quartile over the whole run
(from ``audit.jsonl`` and ``audit_dropped.jsonl``) when the run dropped any sample.
"""

from __future__ import annotations

import argparse
import sys
import pathlib
from collections import Counter, defaultdict
from typing import Any

from sao_megatron.scheduler.stats import stale_drop_by_length
from sao_megatron.training.run.metrics_log import read_metrics


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def _moving_average(ys: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _staleness_counts(records: list[dict[str, Any]]) -> tuple[Counter, str]:
    """Trained action tokens per version lag (``train/token_lag_hist``, {lag: tokens} per step); for
    runs without it, samples per lag from the scheduler (``rollout/staleness_hist/<lag>``)."""
    tokens: Counter = Counter()
    samples: Counter = Counter()
    prefix = "rollout/staleness_hist/"
    for r in records:
        hist = r.get("train/token_lag_hist")
        if isinstance(hist, dict):
            tokens.update({int(k): int(v) for k, v in hist.items()})
        samples.update({int(k[len(prefix):]): int(v) for k, v in r.items()
                        if k.startswith(prefix) and isinstance(v, (int, float))})
    return (tokens, "action tokens") if tokens else (samples, "samples")


def write_report(run_dir: str | pathlib.Path, out_dir: str | pathlib.Path | None = None) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    out = pathlib.Path(out_dir or pathlib.Path(run_dir) / "report")
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name):
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    xs, ys = _series(records, "reward/mean")
    ax.plot(xs, ys, alpha=0.35, label="reward/mean")
    if ys:
        ax.plot(xs, _moving_average(ys, max(1, len(ys) // 20)), label="moving average")
    ax.set(xlabel="trainer step", ylabel="reward", title="Reward")
    ax.legend()
    save(fig, "reward.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    counts, unit = _staleness_counts(records)
    lags = sorted(counts)
    ax.bar(lags, [counts[k] for k in lags])
    ax.set_xticks(lags)
    ax.set(xlabel="version lag (trainer version at training - version that generated it)", ylabel=unit,
           title="Staleness of trained data")
    save(fig, "staleness_hist.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in ("actor/dis_masked_low_frac", "actor/dis_masked_high_frac"):
        ax.plot(*_series(records, key), label=key)
    ax.set(xlabel="trainer step", ylabel="fraction of action tokens", title="DIS masked tokens")
    ax.legend()
    save(fig, "masked_fractions.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(records, "critic/explained_var"))
    ax.set(xlabel="trainer step", ylabel="explained variance", title="Critic explained variance")
    save(fig, "critic_explained_variance.png")

    if _series(records, "eval/pass_at_1")[1] or _series(records, "eval_start/pass_at_1")[1]:
        save(_eval_figure(plt, records), "heldout_eval.png")

    drops = stale_drop_summary(run_dir)
    if drops:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar([f"q{k}" for k in range(1, 5)], [drops[f"rollout/stale_drop_frac_q{k}"] for k in range(1, 5)])
        ax.set(xlabel="response-length quartile (q1 shortest)", ylabel="dropped / finished",
               title=f"Stale drops by length (overall {drops['rollout/stale_drop_frac']:.1%})")
        save(fig, "stale_drops_by_length.png")

    by_phase: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for r in records:
        if "rollout/phase" in r and isinstance(r.get("reward/mean"), (int, float)):
            by_phase[int(r["rollout/phase"])].append((r["step"], float(r["reward/mean"])))
    if len(by_phase) > 1:
        fig, ax = plt.subplots(figsize=(7, 4))
        for phase, pts in sorted(by_phase.items()):
            start = pts[0][0]
            ax.plot([s - start for s, _ in pts], [v for _, v in pts], label=f"phase {phase}")
        ax.set(xlabel="steps since phase start", ylabel="reward", title="Adaptation per phase")
        ax.legend()
        save(fig, "phase_adaptation.png")
    return written


def stale_drop_summary(run_dir: str | pathlib.Path) -> dict[str, float] | None:
    """Stale-drop rate per response-length quartile over the whole run (``scheduler.stats.stale_drop_by_length``
    over the action-token counts of every trained and every dropped sample in the audit); None when
    nothing was dropped or the audit predates lengths."""
    import json

    run_dir = pathlib.Path(run_dir)

    def lengths(name: str) -> list[int] | None:
        path = run_dir / name
        rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln] if path.is_file() else []
        rows = [r for r in rows if r.get("phase") != "sft"]
        return None if any("num_action_tokens" not in r for r in rows) else [r["num_action_tokens"] for r in rows]

    kept, dropped = lengths("audit.jsonl"), lengths("audit_dropped.jsonl")
    if not dropped or kept is None:
        return None
    return stale_drop_by_length(kept, dropped)


def _eval_figure(plt, records: list[dict[str, Any]]):
    """Held-out pass@1 with its CI band and mean reward against trainer steps (``training.run.evaluation``)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = [r for r in records if all(isinstance(r.get(k), (int, float))
                                      for k in ("eval/pass_at_1", "eval/ci_low", "eval/ci_high", "eval/mean_reward"))]
    # eval.before_train: the starting weights, drawn at step -1 (before the first step's update)
    start = [{k.replace("eval_start/", "eval/"): v for k, v in r.items()} | {"step": -1}
             for r in records if isinstance(r.get("eval_start/pass_at_1"), (int, float))][:1]
    rows = start + rows
    xs = [r["step"] for r in rows]
    ax.plot(xs, [r["eval/pass_at_1"] for r in rows], marker="o", label="pass@1")
    ax.fill_between(xs, [r["eval/ci_low"] for r in rows], [r["eval/ci_high"] for r in rows], alpha=0.2,
                    label="95% CI (Wilson)")
    ax.plot(xs, [r["eval/mean_reward"] for r in rows], marker="s", label="mean reward")
    ax.set(xlabel="trainer step", ylabel="held-out score", title="Held-out evaluation")
    ax.legend()
    return fig


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write PNG plots of a run (reward, staleness, masking, critic, held-out eval)")
    p.add_argument("run_dir")
    p.add_argument("--out-dir", default=None, help="default: RUN_DIR/report")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    for path in write_report(args.run_dir, args.out_dir):
        sys.stdout.write(f"{path}\n")
    drops = stale_drop_summary(args.run_dir)
    if drops:
        quartiles = ", ".join(f"q{k} {drops[f'rollout/stale_drop_frac_q{k}']:.1%}" for k in range(1, 5))
        ratio = drops.get("rollout/stale_drop_len_ratio")
        ratio = f"; dropped/mean length {ratio:.2f}" if ratio is not None else ""
        sys.stdout.write(f"stale drops: {drops['rollout/stale_drop_frac']:.1%} of finished samples; by response "
                         f"length {quartiles}{ratio}\n")
    return 0
