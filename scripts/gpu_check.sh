#!/usr/bin/env bash
# GPU acceptance check: prove the production path (Megatron on CUDA with Transformer Engine, bf16,
# distributed optimizer, TP2/EP2 with 2 GPUs, embedded engine, weight sync, parity gate, DSA top-k and
# bf16, memory vs plan) and measure the training step's MFU within 8 minutes on one GPU. Every check
# PASSes having exercised what its name says, FAILs, or says why this node cannot make it (N/A).
#
#   bash scripts/gpu_check.sh [--wheels DIR] [--cpu] [--python PY] [--target DIR] [--budget-s S]
#                             [--only NAME[,NAME...]] [--out DIR] [--allow-skip NAME]... [--no-te]
#
# --wheels DIR  wheels prepared by scripts/gpu_wheels.sh on a machine with network; only what this
#               node lacks is installed (pip --no-index --no-deps --target, never torch).
# --cpu         run everything that does not need a GPU on the CPU; GPU-only checks print N/A
#               ("not applicable on CPU"), which is not a SKIP.
# --allow-skip NAME  accept SKIPs of this check (or line); without it a SKIP is a FAIL. Allowed
#               SKIPs are counted and named in the summary line.
# --require-te  (the default on a GPU) Transformer Engine must be usable and its spec path, grouped
#               experts included, must run; --no-te runs no TE test and the summary names them.
# --python PY   the interpreter whose torch (>= 2.6) has CUDA (default: the first of $PYTHON,
#               python3, python that has one; with --cpu the first with torch).
# --target DIR  where missing packages go (default ~/.cache/sao-megatron/gpu-check-<python tag>).
# --budget-s S  wall-clock budget of all checks together (default 480); each check is cut at
#               its own timeout or at what is left of the budget, whichever comes first.
# --timeout-scale X  multiply every check's timeout by X (a shared or slow node); the budget still caps.
# --only NAMES  run only these checks (see `--list`).
# --out DIR     where logs and the summary go (default: $OUT if set, else runs/gpu_check).
# Prints one line per check: PASS|FAIL|SKIP|N/A|INFO <name> <numbers>, then a summary line; exit 0
# when no check failed, 1 when one did, 2 when the environment could not be prepared.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHEELS=""
MODE=gpu
PY="${PYTHON:-}"
TARGET=""
TE=require
PASS_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) WHEELS="$2"; shift 2 ;;
    --cpu) MODE=cpu; shift ;;
    --python) PY="$2"; shift 2 ;;
    --target) TARGET="$2"; shift 2 ;;
    --budget-s|--timeout-scale|--only|--out|--allow-skip) PASS_ARGS+=("$1" "$2"); shift 2 ;;
    --require-te) TE=require; shift ;;
    --no-te) TE=off; shift ;;
    --list) PASS_ARGS+=("$1"); shift ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

# The interpreter: torch >= 2.6 importable (with CUDA unless --cpu).
probe='import sys, torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 6) and (sys.argv[1] == "cpu" or torch.cuda.is_available()) else 1)'
if [[ -z "$PY" ]]; then
  for cand in python3 python; do
    if command -v "$cand" >/dev/null && "$cand" -c "$probe" "$MODE" 2>/dev/null; then PY=$(command -v "$cand"); break; fi
  done
fi
if [[ -z "$PY" ]] || ! "$PY" -c "$probe" "$MODE" 2>/dev/null; then
  if [[ $MODE == gpu ]]; then
    echo "gpu_check.sh: no python with torch >= 2.6 and a usable CUDA device (tried ${PY:-\$PYTHON, python3, python});" \
         "pass --python PY, or --cpu to check everything that runs without a GPU" >&2
  else
    echo "gpu_check.sh: no python with torch >= 2.6 (tried ${PY:-\$PYTHON, python3, python}); pass --python PY" >&2
  fi
  exit 2
fi
TAG=$("$PY" -c 'import sys, torch; print(f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__.split("+")[0]}")')
TARGET=${TARGET:-${XDG_CACHE_HOME:-$HOME/.cache}/sao-megatron/gpu-check-$TAG}
echo "python: $PY ($TAG); packages missing from it go to $TARGET"

env_args=(--target "$TARGET")
[[ -n "$WHEELS" ]] && env_args+=(--wheels "$WHEELS")
# TE is a GPU requirement (unless --no-te); the CPU mode never needs it.
[[ $MODE == cpu || $TE == off ]] && env_args+=(--no-te)
"$PY" "$REPO/scripts/gpu_env.py" "${env_args[@]}" || exit 2

cd "$REPO" || exit 2
export PYTHONPATH="$TARGET:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PY" "$REPO/scripts/gpu_check.py" --mode "$MODE" --te "$TE" "${PASS_ARGS[@]}"
