#!/usr/bin/env bash
# The CI stage against the real SGLang server: build (idempotently) SGLang's own venv, then run the
# tests marked `sglang` from the main venv (they start SGLang servers with the python it prints).
#
#   bash scripts/ci_sglang.sh [pytest args]
#
# Budget: ~8 min on 2 CPU cores once both venvs exist (a server takes ~25 s to start; the tests
# share one per variant). Prints the 25 slowest tests.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
main_venv="${SAO_MAIN_VENV:-$(bash scripts/setup.sh | tail -n1)}"
export SAO_SGLANG_PYTHON="$(bash scripts/setup.sh --sglang | tail -n1)"
exec "$main_venv/bin/python" -m pytest -m sglang tests/sglang --durations=25 -p no:cacheprovider "$@"
