#!/usr/bin/env bash
# Copy SGLang's own contract files from the pinned wheel into VENV/sglang_contract/.
#
#   bash scripts/sglang_contract.sh VENV
#
# The full sglang package needs CUDA, so the contract tests and
# sao_megatron/rollout/contract.py load single files of the pinned wheel by path.
# Idempotent: a stamp (CONTENTS: the pinned version and the file list) records
# what was extracted; when the version or the list below changes, the files are
# extracted again without touching the venv's packages. Works on a venv that
# scripts/setup.sh has just built and on one that already exists. Each file is
# written to a temporary name and renamed, the stamp last, so a reader never
# sees a half-written file and an interrupted run is redone by the next one.
set -euo pipefail
venv="${1:?usage: bash scripts/sglang_contract.sh VENV}"

SGLANG_VERSION=0.5.23
FILES=(
  sglang/api/v1/api_types.py             # msgspec types of the HTTP JSON API
  sglang/srt/managers/io_struct.py       # control-plane request structs (read with ast)
  sglang/srt/entrypoints/http_server.py  # routes
  sglang/srt/utils/weight_versions.py    # how weight_versions spans are built
  sglang/srt/utils/msgspec_utils.py      # imported by weight_versions.py
  # Weight loaders: which tensors one load_weights call must see together (rollout/loader_groups.py)
  sglang/srt/models/deepseek_common/deepseek_weight_loader.py  # DeepSeek-V3 / V3.2 / GLM-5 loader
  sglang/srt/models/deepseek_v2.py       # DeepSeek/GLM-5 modules (indexer rope style, linears' quant_config)
  sglang/srt/layers/attention/dsa/dsa_indexer.py  # the DSA indexer's linears (wk_weights_proj fusion)
  sglang/srt/models/glm4_moe.py          # GLM-4.5 loader; GlmMoeDsaForCausalLM's base class
  sglang/srt/models/qwen3_moe.py         # Qwen3-MoE loader
  sglang/srt/layers/quantization/utils.py  # is_layer_skipped: how modules_to_not_convert matches
  sglang/srt/layers/quantization/fp8.py  # Fp8Config.from_config: which quantization_config keys it reads
  sglang/srt/layers/quantization/fp8_utils.py  # block_quant_dequant (the fused indexer's FP8 wk)
  sglang/srt/layers/moe/fused_moe_triton/layer.py  # FusedMoE.make_expert_params_mapping
  sglang/srt/weight_sync/tensor_bucket.py  # FlattenedTensorBucket: the receiving end of a flattened bucket
)

dst="$venv/sglang_contract"
stamp="$dst/CONTENTS"
want="$(printf 'sglang==%s\n' "$SGLANG_VERSION"; printf '%s\n' "${FILES[@]}")"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

echo "setup: extracting the SGLang $SGLANG_VERSION contract files into $dst" >&2
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$venv/bin/python" -m pip download -q --no-deps "sglang==$SGLANG_VERSION" -d "$tmp" >&2
"$venv/bin/python" - "$tmp" "$dst" "$SGLANG_VERSION" "${FILES[@]}" <<'PY'
import os, pathlib, sys, zipfile

src, dst, version, names = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
dst.mkdir(parents=True, exist_ok=True)


def write(path: pathlib.Path, data: bytes) -> None:
    part = path.with_name(f".{path.name}.{os.getpid()}")
    part.write_bytes(data)
    os.replace(part, path)


flat = [pathlib.PurePosixPath(n).name for n in names]
if len(set(flat)) != len(flat):  # files land flat in dst: two of one name would overwrite each other
    sys.exit(f"setup: FILES in scripts/sglang_contract.sh repeat a file name: {sorted(flat)}")
wheel = next(src.glob(f"sglang-{version}-*.whl"))
with zipfile.ZipFile(wheel) as zf:
    missing = [n for n in names if n not in zf.namelist()]
    if missing:
        sys.exit(f"setup: {wheel.name} lacks {missing}; fix FILES in scripts/sglang_contract.sh")
    for name in names:
        write(dst / pathlib.PurePosixPath(name).name, zf.read(name))
write(dst / "VERSION", f"{version}\n".encode())
PY
printf '%s\n' "$want" >"$stamp.$$"
mv "$stamp.$$" "$stamp"
