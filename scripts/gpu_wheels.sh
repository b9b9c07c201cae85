#!/usr/bin/env bash
# Prepare the folder of wheels that scripts/gpu_check.sh installs on a GPU node without network.
#
#   bash scripts/gpu_wheels.sh [OUT_DIR] [--arch x86_64|aarch64] [--python-version 3.12] [--without-hf]
#
# Run it on any machine with network access to PyPI (it needs only python3 with pip; no GPU,
# no torch). It downloads, without dependencies, exactly the wheels pinned in
# scripts/gpu_requirements.txt for the node's CPython version and architecture (default:
# CPython 3.12 on x86_64 Linux, glibc >= 2.28), then prints the folder's size and contents.
# Copy OUT_DIR to the node and run `bash scripts/gpu_check.sh --wheels OUT_DIR`.
# --without-hf leaves out transformers and its stack (~20 MB) for nodes that already have them.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT="$REPO/gpu_wheels"
ARCH=x86_64
PYVER=3.12
WITH_HF=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --arch) ARCH="$2"; shift 2 ;;
    --python-version) PYVER="$2"; shift 2 ;;
    --without-hf) WITH_HF=0; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    -*) echo "gpu_wheels.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) OUT="$1"; shift ;;
  esac
done
case "$ARCH" in x86_64|aarch64) ;; *) echo "gpu_wheels.sh: --arch must be x86_64 or aarch64" >&2; exit 2 ;; esac
PY=${PYTHON:-python3}
ABI="cp${PYVER/./}"

mkdir -p "$OUT"
REQS="$OUT/requirements.txt"
# The HF block is everything after its heading up to the next heading.
if [[ $WITH_HF == 1 ]]; then
  grep -v '^\s*#' "$REPO/scripts/gpu_requirements.txt" | sed 's/\s*#.*//' | grep . > "$REQS"
else
  awk '/^# Hugging Face/{skip=1; next} /^# /{skip=0} !skip' "$REPO/scripts/gpu_requirements.txt" \
    | grep -v '^\s*#' | sed 's/\s*#.*//' | grep . > "$REQS"
fi

platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014; do
  platforms+=(--platform "${tag}_${ARCH}")
done
# --no-deps: the pinned list is already closed over what the node lacks (torch's own
# dependencies excluded on purpose); binary wheels only, for the node's interpreter.
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
  --python-version "$PYVER" --abi "$ABI" --abi abi3 --abi none "${platforms[@]}" \
  -r "$REQS" -d "$OUT"
cp "$REPO/scripts/gpu_requirements.txt" "$OUT/gpu_requirements.txt"

echo "wheels for CPython $PYVER on $ARCH Linux in $OUT:"
ls -1 "$OUT"/*.whl | xargs -n1 basename
echo "$(ls -1 "$OUT"/*.whl | wc -l) wheels, $(du -sh "$OUT" | cut -f1) in all"
