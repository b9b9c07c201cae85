"""The checks behind scripts/gpu_check.sh: one line per check, every check time-bounded.

    python scripts/gpu_check.py --mode gpu|cpu [--budget-s S] [--only a,b] [--out DIR] [--list]

Run through gpu_check.sh (it picks the interpreter and installs what is missing). Each check runs
in its own subprocess (Megatron's global state, the CPU shims and CUDA contexts never leak from one
check into the next) under ``min(its timeout, what is left of the budget)``; a check cut by its
timeout is a FAIL that says so. ``--mode cpu`` runs what needs no GPU on the CPU and prints SKIP,
with the reason, for what does. Lines: ``PASS|FAIL|SKIP <check> <numbers>``. The summary (JSON and
the printed lines) goes to ``--out``, else ``$OUT`` when set, else ``runs/gpu_check``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import signal
import sys
import time
from collections.abc import Callable

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check_lib as lib  # noqa: E402  (after the path insert: a sibling module)


@dataclasses.dataclass(kw_only=True, slots=True)
class Check:
    """One named check: ``run(ctx)`` returns the lines it prints."""

    name: str
    """Name on its line and for --only."""
    run: Callable[[lib.Context], list[lib.Line]]
    """The check (gets the context: mode, output folder, a time-bounded subprocess runner)."""
    timeout_s: dict[str, float]
    """Seconds allowed per mode ('gpu': one H200 node, the sum fits 5 minutes; 'cpu': generous, CI boxes
    are shared and the CPU runs the models too)."""


CHECKS = [
    Check(name="env", run=lib.check_env, timeout_s={"gpu": 60, "cpu": 300}),
    Check(name="gpu-tests", run=lib.check_gpu_tests, timeout_s={"gpu": 150, "cpu": 600}),
    Check(name="sao-run", run=lib.check_sao_run, timeout_s={"gpu": 150, "cpu": 1200}),
    Check(name="parity", run=lib.check_parity, timeout_s={"gpu": 90, "cpu": 900}),
    Check(name="gloo-tp2-ep2", run=lib.check_gloo_layouts, timeout_s={"gpu": 90, "cpu": 60}),
    Check(name="memory-vs-plan", run=lib.check_memory, timeout_s={"gpu": 90, "cpu": 300}),
    Check(name="bench-gae", run=lib.check_bench_gae, timeout_s={"gpu": 45, "cpu": 300}),
    Check(name="bench-logprobs", run=lib.check_bench_logprobs, timeout_s={"gpu": 60, "cpu": 300}),
    Check(name="one-gpu-limits", run=lib.check_limits, timeout_s={"gpu": 1, "cpu": 1}),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--budget-s", type=float, default=None, help="all checks together (gpu 290, cpu 3600)")
    parser.add_argument("--only", default=None, help="comma-separated check names")
    parser.add_argument("--out", default=None)
    parser.add_argument("--list", action="store_true", help="print the check names and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(c.name for c in CHECKS))
        return 0
    names = [c.name for c in CHECKS]
    only = names if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(only) - set(names))
    if unknown:
        raise SystemExit(f"gpu_check: unknown check(s) {unknown}; choose from {names}")
    out = pathlib.Path(args.out or os.environ.get("OUT") or REPO / "runs" / "gpu_check")
    budget = args.budget_s or (290.0 if args.mode == "gpu" else 3600.0)
    ctx = lib.Context(mode=args.mode, out=out, deadline=time.monotonic() + budget)
    out.mkdir(parents=True, exist_ok=True)
    print(f"gpu_check ({args.mode} mode): {len(only)} checks, budget {budget:.0f} s, logs in {out}/logs", flush=True)
    lines: list[lib.Line] = []
    t_start = time.monotonic()
    for check in CHECKS:
        if check.name in only:
            lines += run_check(check, ctx)
    failed = [ln for ln in lines if ln.status == "FAIL"]
    summary = {"mode": args.mode, "seconds": round(time.monotonic() - t_start, 1), "budget_s": budget,
               "failed": len(failed), "lines": [dataclasses.asdict(ln) for ln in lines]}
    (out / "gpu_check_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "gpu_check_summary.txt").write_text("".join(ln.text() + "\n" for ln in lines))
    print(f"gpu_check: {sum(ln.status == 'PASS' for ln in lines)} PASS, {len(failed)} FAIL, "
          f"{sum(ln.status == 'SKIP' for ln in lines)} SKIP in {summary['seconds']:.0f} s; "
          f"summary {out / 'gpu_check_summary.json'}", flush=True)
    return 1 if failed else 0


def run_check(check: Check, ctx: lib.Context) -> list[lib.Line]:
    """The check's lines, printed as they come; an exception or a timeout becomes one FAIL line."""
    ctx.timeout_s = check.timeout_s[ctx.mode]
    t0 = time.monotonic()
    if ctx.left() < 5:
        lines = [lib.Line("FAIL", check.name, "not started: the time budget is spent (raise --budget-s)")]
    else:
        try:
            lines = check.run(ctx)
        except lib.CheckTimeout as exc:
            lines = [lib.Line("FAIL", check.name, str(exc))]
        except Exception as exc:  # a broken check must not hide the others
            lines = [lib.Line("FAIL", check.name, f"{type(exc).__name__}: {exc}")]
    for ln in lines:
        ln.seconds = ln.seconds if ln.seconds is not None else round(time.monotonic() - t0, 1)
        print(ln.text(), flush=True)
    return lines


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
