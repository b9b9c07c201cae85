"""Step efficiency of the main job with the weight push synchronous vs overlapped, side by side (issue 24).

Runs ``sao-megatron train`` on configs/experiments/tiny_cpu.yaml (fewer steps) once per arm,
``rollout.weight_sync.overlap`` false then true (``--repeats`` alternates the order), and prints per
arm the medians over the RL steps of step, train, wait_batch, weight_sync (what the step blocked on
publishing), audit (rank 0's audit lines and dropped samples) and weight_push (the push itself, in the
background when overlapped), the step
efficiency Σtrain/Σstep, the wall-clock efficiency Σtrain/(wall clock between the first and the last
step's log line, which also counts logging and checkpoints between steps), reward first 10 % → last 20 % of steps,
stale drops, and the ratio overlap/sync. The box's load average (``uptime``) is printed with each arm:
wall times on a shared machine are inflated by load, the side-by-side ratios less so.

    python benchmarks/step_efficiency.py                     # embedded engines, 60 steps per arm
    python benchmarks/step_efficiency.py --engine sglang     # real SGLang ($SAO_SGLANG_PYTHON or --sglang-python)
    python benchmarks/step_efficiency.py --steps 30 --set rollout.weight_sync.transport=distributed
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "experiments" / "tiny_cpu.yaml"
COLUMNS = ("step_s", "train_s", "wait_batch_s", "weight_sync_s", "audit_s", "weight_push_s")


def load_average() -> str:
    return "%.1f %.1f %.1f" % os.getloadavg()


def run_arm(args, overlap: bool, run_dir: pathlib.Path) -> dict:
    sets = [f"run.num_steps={args.steps}", f"rollout.weight_sync.overlap={str(overlap).lower()}",
            "checkpoint.save_interval=0", "logging.log_interval=1", *args.set]
    if args.engine == "sglang":
        sets += ["rollout.engine=sglang", f"rollout.sglang_python={args.sglang_python}"]
    cmd = [sys.executable, "-m", "sao_megatron.cli", "train", "--config", str(CONFIG), "--run-dir", str(run_dir),
           "--resume", "never", *[a for s in sets for a in ("--set", s)]]
    load_before = load_average()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"arm overlap={overlap} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return summarize(run_dir, overlap, step_times(proc.stdout + proc.stderr)) | {
        "load": f"{load_before} -> {load_average()}", "process_s": time.perf_counter() - t0}


def step_times(log: str) -> dict[int, float]:
    """Step → when its log line was written (``logging.log_interval=1``: every step, after its metrics)."""
    out = {}
    for m in re.finditer(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \S+metrics_log: step (\d+) ", log, re.M):
        out[int(m.group(2))] = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return out


def summarize(run_dir: pathlib.Path, overlap: bool, logged: dict[int, float]) -> dict:
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step[rec["step"]] = rec
    steps = [by_step[k] for k in sorted(by_step)]
    col = {c: [m.get(f"timing/{c}", 0.0) for m in steps] for c in COLUMNS}
    n = len(steps)
    first, last = steps[: max(1, n // 10)], steps[-max(1, n // 5):]
    reward = [statistics.fmean(m["reward/mean"] for m in part) for part in (first, last)]
    # Wall clock from the first step's log line to the last one's: steps 1..n-1 with everything between them.
    timed = [m for m in steps[1:] if m["step"] in logged]
    wall = logged[steps[-1]["step"]] - logged[steps[0]["step"]] if timed and steps[0]["step"] in logged else 0.0
    wall_eff = sum(m["timing/train_s"] for m in timed) / wall if wall > 0 else float("nan")
    return {"overlap": overlap, "steps": n, **{c: statistics.median(v) for c, v in col.items()},
            "efficiency": sum(col["train_s"]) / sum(col["step_s"]), "wall_efficiency": wall_eff,
            "reward": reward, "dropped_stale": sum(m.get("rollout/dropped_stale", 0.0) for m in steps)}


def show(rows: list[dict]) -> None:
    head = f"{'arm':<9}" + "".join(f"{c:>14}" for c in COLUMNS) + f"{'Σtrain/Σstep':>14}{'Σtrain/wall':>13}"
    print(head + f"{'reward':>16}{'drops':>7}  load (1/5/15 min, before -> after)")
    for r in rows:
        name = "overlap" if r["overlap"] else "sync"
        print(f"{name:<9}" + "".join(f"{r[c]:>14.3f}" for c in COLUMNS) + f"{r['efficiency']:>14.3f}"
              f"{r['wall_efficiency']:>13.3f}{r['reward'][0]:>8.3f}->{r['reward'][1]:.3f}{r['dropped_stale']:>7.0f}"
              f"  {r['load']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["embedded", "sglang"], default="embedded")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=1, help="pairs of runs; the order alternates")
    p.add_argument("--sglang-python", default=os.environ.get("SAO_SGLANG_PYTHON"))
    p.add_argument("--set", action="append", default=[], help="extra config overrides for both arms")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--keep", help="keep the run directories under this path")
    args = p.parse_args()
    if args.engine == "sglang" and not args.sglang_python:
        p.error("--engine sglang needs --sglang-python or $SAO_SGLANG_PYTHON (bash scripts/setup.sh --sglang)")
    root = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="step_eff_"))
    rows = []
    for i in range(args.repeats):
        for overlap in ((False, True) if i % 2 == 0 else (True, False)):
            rows.append(run_arm(args, overlap, root / f"{'overlap' if overlap else 'sync'}_{i}"))
            print(f"# done: overlap={overlap} repeat {i} ({rows[-1]['process_s']:.0f} s)", flush=True)
    print(f"\nmain job, engine={args.engine}, {args.steps} steps per arm, medians over RL steps (s)")
    show(rows)
    for i in range(args.repeats):
        pair = {r["overlap"]: r for r in rows[2 * i: 2 * i + 2]}
        print(f"ratio overlap/sync (repeat {i}): median step {pair[True]['step_s'] / pair[False]['step_s']:.2f}, "
              f"Σtrain/Σstep {pair[True]['efficiency'] / pair[False]['efficiency']:.2f}, "
              f"Σtrain/wall {pair[True]['wall_efficiency'] / pair[False]['wall_efficiency']:.2f}")


if __name__ == "__main__":
    main()
