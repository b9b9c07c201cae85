#!/usr/bin/env bash
# Prepare the folder of wheels that scripts/gpu_check.sh installs on a GPU node without network.
#
#   bash scripts/gpu_wheels.sh [OUT_DIR] [--arch x86_64|aarch64] [--python-version 3.12] [--without-hf]
#                              [--no-te] [--no-optional] [--dry-run]
#
# Run it on any machine with network access to PyPI (it needs only python3 with pip; no GPU,
# no torch). It downloads, without dependencies, exactly the wheels pinned in
# scripts/gpu_requirements.txt for the node's CPython version and architecture (default:
# CPython 3.12 on x86_64 Linux, glibc >= 2.28), then prints the folder's size and contents.
# Copy OUT_DIR to the node and run `bash scripts/gpu_check.sh --wheels OUT_DIR`.
# --without-hf leaves out transformers and its stack (~20 MB) for nodes that already have them.
# Also the GPU kernels: Transformer Engine ('te': required by gpu_check.sh on a GPU unless --no-te;
# transformer-engine-torch has no binary wheel and comes as source, built on the node), tilelang
# and cudnn-frontend ('optional': DSA's fused kernels for full-length GLM-5 runs, never needed by
# the check). --no-te / --no-optional leave those groups out (several GB for TE's CUDA libraries).
# --dry-run prints the requirement lists and the pip commands without downloading anything.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT="$REPO/gpu_wheels"
ARCH=x86_64
PYVER=3.12
WITH_HF=1
DROP_TAGS=()
DRY=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --arch) ARCH="$2"; shift 2 ;;
    --python-version) PYVER="$2"; shift 2 ;;
    --without-hf) WITH_HF=0; shift ;;
    --no-te) DROP_TAGS+=(te); shift ;;
    --no-optional) DROP_TAGS+=(optional); shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    -*) echo "gpu_wheels.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) OUT="$1"; shift ;;
  esac
done
case "$ARCH" in x86_64|aarch64) ;; *) echo "gpu_wheels.sh: --arch must be x86_64 or aarch64" >&2; exit 2 ;; esac
PY=${PYTHON:-python3}
ABI="cp${PYVER/./}"

mkdir -p "$OUT"
REQS="$OUT/requirements.txt"
SDISTS="$OUT/requirements-sdist.txt"
# The HF block is everything after its heading up to the next heading; tagged lines per the flags.
if [[ $WITH_HF == 1 ]]; then
  lines=$(cat "$REPO/scripts/gpu_requirements.txt")
else
  lines=$(awk '/^# Hugging Face/{skip=1; next} /^# /{skip=0} !skip' "$REPO/scripts/gpu_requirements.txt")
fi
lines=$(grep -v '^\s*#' <<<"$lines" | grep .)
for tag in "${DROP_TAGS[@]}"; do
  lines=$(grep -vE "#.*\b$tag\b" <<<"$lines" || true)
done
grep -vE '#.*\bsdist\b' <<<"$lines" | sed 's/\s*#.*//' | grep . > "$REQS" || true
(grep -E '#.*\bsdist\b' <<<"$lines" || true) | sed 's/\s*#.*//' | { grep . || true; } > "$SDISTS"

platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014; do
  platforms+=(--platform "${tag}_${ARCH}")
done
# --no-deps: the pinned list is already closed over what the node lacks (torch's own
# dependencies excluded on purpose); binary wheels only, for the node's interpreter.
binary=("$PY" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp
  --python-version "$PYVER" --abi "$ABI" --abi abi3 --abi none "${platforms[@]}" -r "$REQS" -d "$OUT")
# Source distributions (no wheel on PyPI): built on the node, against its own torch and CUDA.
source=("$PY" -m pip download --quiet --no-deps --no-binary=:all: -r "$SDISTS" -d "$OUT")
if [[ $DRY == 1 ]]; then
  echo "wheels ($(wc -l < "$REQS")) for CPython $PYVER on $ARCH Linux:"; sed 's/^/  /' "$REQS"
  echo "sources ($(wc -l < "$SDISTS")), built on the node:"; sed 's/^/  /' "$SDISTS"
  echo "would run: ${binary[*]}"
  [[ -s "$SDISTS" ]] && echo "would run: ${source[*]}"
  exit 0
fi
"${binary[@]}"
[[ -s "$SDISTS" ]] && "${source[@]}"
cp "$REPO/scripts/gpu_requirements.txt" "$OUT/gpu_requirements.txt"

echo "wheels for CPython $PYVER on $ARCH Linux in $OUT:"
ls -1 "$OUT"/*.whl "$OUT"/*.tar.gz 2>/dev/null | xargs -n1 basename
echo "$(ls -1 "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in all"
