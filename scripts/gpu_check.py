"""The checks behind scripts/gpu_check.sh: one line per check, every check time-bounded.

    python scripts/gpu_check.py --mode gpu|cpu [--budget-s S] [--only a,b] [--out DIR] [--list]

Run through gpu_check.sh (it picks the interpreter and installs what is missing). Each check runs
in its own subprocess (Megatron's global state, the CPU shims and CUDA contexts never leak from one
check into the next) under ``min(its timeout, what is left of the budget)``; a check cut by its
timeout is a FAIL that says so (its limit covers all its commands together). The per-check
timeouts of a mode add up to at most its default budget (GPU: 8 minutes on one GPU). ``--mode cpu`` runs what needs no GPU on the CPU and prints
N/A ("not applicable on CPU"), with the reason, for what does: that is not a SKIP. A SKIP (a
gpu-marked test that skipped) is a FAIL unless ``--allow-skip`` names its check or line; allowed
SKIPs are counted and named in the summary. Lines: ``PASS|FAIL|SKIP|N/A|INFO <check> <numbers>``;
exit 1 when any line is a FAIL. The summary (JSON and the printed lines) goes to ``--out``, else
``$OUT`` when set, else ``runs/gpu_check``.
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
import gpu_check_multi as multi  # noqa: E402


@dataclasses.dataclass(kw_only=True, slots=True)
class Check:
    """One named check: ``run(ctx)`` returns the lines it prints."""

    name: str
    """Name on its line and for --only."""
    run: Callable[[lib.Context], list[lib.Line]]
    """The check (gets the context: mode, output folder, a time-bounded subprocess runner)."""
    timeout_s: dict[str, float]
    """Seconds allowed per mode, for all the check's commands together ('gpu': one H200 node, the sum
    fits the 8 minutes; 'cpu': generous, CI boxes are shared and the CPU runs the models too)."""


# GPU timeouts: one H200, from the first run (2026-12-04: env 20 s, dsa-topk 20 s, bench gae 12 s,
# bench logprobs 19 s) where a check got that far, else estimates with headroom (docs/gpu-node.md).
CHECKS = [
    Check(name="env", run=lib.check_env, timeout_s={"gpu": 25, "cpu": 120}),
    Check(name="gpu-tests", run=lib.check_gpu_tests, timeout_s={"gpu": 80, "cpu": 5}),
    Check(name="sao-run", run=lib.check_sao_run, timeout_s={"gpu": 80, "cpu": 1500}),
    Check(name="parity", run=lib.check_parity, timeout_s={"gpu": 35, "cpu": 600}),
    Check(name="weight-sync", run=multi.check_weight_sync, timeout_s={"gpu": 20, "cpu": 120}),
    Check(name="tp2-ep2", run=multi.check_tp_ep_layouts, timeout_s={"gpu": 40, "cpu": 5}),
    Check(name="dsa-topk", run=multi.check_dsa_topk, timeout_s={"gpu": 25, "cpu": 5}),
    Check(name="dsa-bf16", run=multi.check_dsa_bf16, timeout_s={"gpu": 20, "cpu": 200}),
    Check(name="memory-vs-plan", run=lib.check_memory, timeout_s={"gpu": 30, "cpu": 200}),
    Check(name="bench-gae", run=lib.check_bench_gae, timeout_s={"gpu": 15, "cpu": 300}),
    Check(name="bench-logprobs", run=lib.check_bench_logprobs, timeout_s={"gpu": 20, "cpu": 300}),
    Check(name="bench-train-step", run=lib.check_bench_train_step, timeout_s={"gpu": 80, "cpu": 200}),
    Check(name="one-gpu-limits", run=lib.check_limits, timeout_s={"gpu": 1, "cpu": 1}),
]
BUDGET_S = {"gpu": 480.0, "cpu": 3600.0}
"""Default budgets: 8 minutes on one GPU; the per-check timeouts add up to no more (a test sums them),
and each check's commands together stay within its own timeout."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["gpu", "cpu"], default="gpu")
    parser.add_argument("--budget-s", type=float, default=None, help="all checks together (gpu 480, cpu 3600)")
    parser.add_argument("--only", default=None, help="comma-separated check names")
    parser.add_argument("--out", default=None)
    parser.add_argument("--allow-skip", action="append", default=[], metavar="NAME",
                        help="a check (or line) whose SKIPs are accepted; repeat or comma-separate")
    parser.add_argument("--te", choices=["require", "off"], default="require",
                        help="GPU mode: Transformer Engine required (default) or explicitly not checked")
    parser.add_argument("--timeout-scale", type=float, default=1.0,
                        help="multiply every check's timeout (a shared or slow node; the budget still caps them)")
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
    if args.timeout_scale <= 0:
        raise SystemExit(f"gpu_check: --timeout-scale must be > 0, got {args.timeout_scale}")
    allow = {n.strip() for a in args.allow_skip for n in a.split(",") if n.strip()}
    out = pathlib.Path(args.out or os.environ.get("OUT") or REPO / "runs" / "gpu_check")
    budget = args.budget_s or BUDGET_S[args.mode]
    ctx = lib.Context(mode=args.mode, out=out, deadline=time.monotonic() + budget, require_te=args.te == "require",
                      timeout_scale=args.timeout_scale)
    out.mkdir(parents=True, exist_ok=True)
    print(f"gpu_check ({args.mode} mode): {len(only)} checks, budget {budget:.0f} s, logs in {out}/logs", flush=True)
    lines: list[lib.Line] = []
    t_start = time.monotonic()
    for check in CHECKS:
        if check.name in only:
            lines += run_check(check, ctx, allow)
    summary = summarise(lines, mode=args.mode, seconds=time.monotonic() - t_start, budget=budget, allow=allow,
                        require_te=ctx.require_te)
    (out / "gpu_check_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "gpu_check_summary.txt").write_text("".join(ln.text() + "\n" for ln in lines) + summary["text"] + "\n")
    print(summary["text"] + f"; summary {out / 'gpu_check_summary.json'}", flush=True)
    return 1 if summary["failed"] else 0


def apply_skip_policy(lines: list[lib.Line], check: str, allow: set[str]) -> list[lib.Line]:
    """A SKIP stays a SKIP only when --allow-skip names its check or its line; otherwise it is a FAIL."""
    out = []
    for ln in lines:
        if ln.status == "SKIP" and check not in allow and ln.name not in allow:
            ln = lib.Line("FAIL", ln.name, f"skipped, and a SKIP is a failure unless allowed "
                          f"(--allow-skip {check}): {ln.detail}", ln.seconds)
        out.append(ln)
    return out


def summarise(lines: list[lib.Line], *, mode: str, seconds: float, budget: float, allow: set[str],
              require_te: bool) -> dict:
    count = {s: sum(ln.status == s for ln in lines) for s in ("PASS", "FAIL", "SKIP", lib.NA, "INFO")}
    skipped = [ln.name for ln in lines if ln.status == "SKIP"]
    sync = next((ln.detail for ln in lines if ln.name == "weight-sync"), "")
    notes = [f"{count['SKIP']} SKIP allowed ({', '.join(skipped)})" if skipped else "0 SKIP"]
    if "NCCL NOT exercised" in sync:
        notes.append("NCCL NOT exercised")
    if mode == "gpu" and not require_te:
        notes.append(f"Transformer Engine NOT checked (--no-te: {lib.TE_TESTS} not run)")
    if mode == "gpu":  # on a GPU an N/A is a check this node cannot make (too few GPUs): named
        na = [ln.name for ln in lines if ln.status == lib.NA]
        notes.append(f"{len(na)} not applicable here" + (f" ({', '.join(na)})" if na else ""))
    else:
        notes.append(f"{count[lib.NA]} not applicable on CPU")
    text = (f"gpu_check: {count['PASS']} PASS, {count['FAIL']} FAIL, " + ", ".join(notes)
            + f" in {seconds:.0f} s (budget {budget:.0f} s)")
    return {"mode": mode, "seconds": round(seconds, 1), "budget_s": budget, "failed": count["FAIL"],
            "counts": count, "allowed_skips": skipped, "text": text, "lines": [dataclasses.asdict(ln) for ln in lines]}


def run_check(check: Check, ctx: lib.Context, allow: set[str] = frozenset()) -> list[lib.Line]:
    """The check's lines, printed as they come; an exception or a timeout becomes one FAIL line."""
    ctx.timeout_s = check.timeout_s[ctx.mode] * ctx.timeout_scale
    t0 = time.monotonic()
    ctx.check_deadline = float("inf")  # the budget alone decides whether the check starts
    if ctx.left() < 5:
        lines = [lib.Line("FAIL", check.name, "not started: the time budget is spent (raise --budget-s)")]
    else:
        ctx.check_deadline = t0 + ctx.timeout_s  # every command of the check within its limit
        try:
            lines = check.run(ctx)
        except lib.CheckTimeout as exc:
            lines = [lib.Line("FAIL", check.name, str(exc))]
        except Exception as exc:  # a broken check must not hide the others
            lines = [lib.Line("FAIL", check.name, f"{type(exc).__name__}: {exc}")]
    lines = apply_skip_policy(lines, check.name, allow)
    for ln in lines:
        ln.seconds = ln.seconds if ln.seconds is not None else round(time.monotonic() - t0, 1)
        print(ln.text(), flush=True)
    return lines


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
