#!/usr/bin/env bash
# Idempotent environment setup for CPU machines and CI.
#
# The virtual environment lives outside the checkout, keyed by the hash of
# requirements.txt, so a second run (or a fresh clone in another folder, which
# is how CI runs) costs seconds. The package itself is installed editable into
# that venv on every run (a few seconds) so the venv always points at the
# checkout that called this script.
#
# Prints the venv path on the last line of stdout.
#
#   bash scripts/setup.sh --sglang   builds (idempotently) the real SGLang server's own Python 3.11
#                                     venv from requirements-sglang.txt instead, and prints its python
#                                     on the last line. It never touches the main venv.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

if [ "${1:-}" = "--sglang" ]; then
  # Bump SGLANG_ENV_REV when the steps below change in a way that needs a new venv.
  SGLANG_ENV_REV=1
  py="${SAO_SGLANG_PYTHON:-}"
  if [ -z "$py" ]; then
    for cand in python3.11 "$HOME/.pyenv/versions/3.11.7/bin/python3.11"; do
      if command -v "$cand" >/dev/null 2>&1; then py="$cand"; break; fi
    done
  fi
  [ -n "$py" ] || { echo "setup: Python 3.11 not found (the sglang 0.5.23 wheel is built for CPython 3.11 only); set SAO_SGLANG_PYTHON=/path/to/python3.11" >&2; exit 1; }
  hash="$( (cat requirements-sglang.txt; echo "rev=$SGLANG_ENV_REV") | sha256sum | cut -c1-16)"
  root="${SAO_ENV_ROOT:-$HOME/.cache/sao-megatron}"
  venv="$root/sglang-venv-$hash"
  mkdir -p "$root"
  if [ ! -f "$venv/.complete" ]; then
    echo "setup: building $venv (first run takes ~5 minutes and ~11 GB: sglang with every pinned dependency)" >&2
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
    "$venv/bin/python" -m pip install -q -r requirements-sglang.txt >&2
    "$venv/bin/python" -c 'import importlib.metadata as m; v = m.version("sglang"); assert v == "0.5.23", v' >&2
    touch "$venv/.complete"
  fi
  echo "$venv/bin/python"
  exit 0
fi

py="${SAO_PYTHON:-}"
if [ -z "$py" ]; then
  for cand in python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python3.12"; do
    if command -v "$cand" >/dev/null 2>&1; then py="$cand"; break; fi
  done
fi
[ -n "$py" ] || { echo "setup: Python 3.12 not found (megatron-core>=0.17 needs it); set SAO_PYTHON=/path/to/python3.12" >&2; exit 1; }

# Bump ENV_REV when the build steps below change in a way that needs a new venv.
ENV_REV=1
hash="$( (cat requirements.txt; echo "rev=$ENV_REV") | sha256sum | cut -c1-16)"
root="${SAO_ENV_ROOT:-$HOME/.cache/sao-megatron}"
venv="$root/venv-$hash"
mkdir -p "$root"

if [ ! -f "$venv/.complete" ]; then
  echo "setup: building $venv (first run takes ~5 minutes: torch + megatron-core)" >&2
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q -r requirements.txt >&2
  touch "$venv/.complete"
fi

# SGLang contract files from the pinned wheel: a separate idempotent step (its own stamp), so a
# change to the file list re-extracts them without rebuilding the venv.
bash "$repo/scripts/sglang_contract.sh" "$venv"

# Quiet unless it fails (setuptools prints multi-line notices on every editable install).
if ! out="$("$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$repo" 2>&1)"; then
  echo "$out" >&2
  echo "setup: installing the package into $venv failed" >&2
  exit 1
fi
echo "$venv"
