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
shopt -s inherit_errexit  # a failing step inside build_venv "$(...)" stops the script
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
root="${SAO_ENV_ROOT:-$HOME/.cache/sao-megatron}"
mkdir -p "$root"

# find_python VERSION OVERRIDE_VAR WHY: the interpreter to build a venv from.
find_python() {
  local version="$1" override="$2" why="$3" cand
  if [ -n "${!override:-}" ]; then echo "${!override}"; return; fi
  for cand in "python$version" "$HOME"/.pyenv/versions/"$version".*/bin/"python$version"; do
    if command -v "$cand" >/dev/null 2>&1; then echo "$cand"; return; fi
  done
  echo "setup: Python $version not found ($why); set $override=/path/to/python$version" >&2
  exit 1
}

# build_venv NAME PYTHON REQUIREMENTS REV WHAT: the venv keyed by the requirements file and REV
# (bump REV when the build steps change in a way that needs a new venv); built once, then reused.
build_venv() {
  local name="$1" py="$2" reqs="$3" rev="$4" what="$5" hash venv
  hash="$( (cat "$reqs"; echo "rev=$rev") | sha256sum | cut -c1-16)"
  venv="$root/$name-$hash"
  if [ ! -f "$venv/.complete" ]; then
    echo "setup: building $venv (first run takes $what)" >&2
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
    "$venv/bin/python" -m pip install -q -r "$reqs" >&2
    if [ "$name" = sglang-venv ]; then
      "$venv/bin/python" -c 'import importlib.metadata as m; v = m.version("sglang"); assert v == "0.5.23", v' >&2
    fi
    touch "$venv/.complete"
  fi
  echo "$venv"
}

if [ "${1:-}" = "--sglang" ]; then
  py="$(find_python 3.11 SAO_PYTHON311 "the sglang 0.5.23 wheel is built for CPython 3.11 only")"
  venv="$(build_venv sglang-venv "$py" requirements-sglang.txt 1 "~5 minutes and ~11 GB: sglang with every pinned dependency")"
  echo "$venv/bin/python"
  exit 0
fi

py="$(find_python 3.12 SAO_PYTHON "megatron-core>=0.17 needs it")"
venv="$(build_venv venv "$py" requirements.txt 1 "~5 minutes: torch + megatron-core")"

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
