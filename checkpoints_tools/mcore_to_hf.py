"""Megatron distributed checkpoint -> HF safetensors (sharded + index) + the template's config/tokenizer.

Weights are streamed through the library exporter
(``sao_megatron.weights.export``), the same path the trainer's weight sync
uses, and written by rank 0 shard by shard.
"""

from __future__ import annotations

import json
import logging
import pathlib
import shutil

import torch

from sao_megatron.config.schema import ModelConfig
from sao_megatron.models.families import ConversionError, get_family, hf_config_from_model
from sao_megatron.models.families.fp8 import strip_quantization_config
from sao_megatron.models.families.hf_config import read_hf_config

from checkpoints_tools import common, mtp

logger = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def template_files(template: pathlib.Path) -> list[pathlib.Path]:
    """Every non-weight file of the HF template (config, generation config, tokenizer, chat template...)."""
    return sorted(p for p in template.iterdir() if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES)
                  and p.name != "model.safetensors.index.json" and not p.name.startswith("."))


def output_dtype(model_cfg: ModelConfig, hf_template: pathlib.Path | None, dtype: str | None) -> torch.dtype:
    """--dtype, else the template config's dtype, else the checkpoint's params_dtype."""
    if dtype is None and hf_template is not None:
        cfg = read_hf_config(hf_template)
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "").removeprefix("torch.") or None
    if dtype is None:
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[model_cfg.params_dtype]
    if dtype not in _TORCH_DTYPES:
        raise ConversionError(f"output dtype '{dtype}' is not supported; use one of {', '.join(_TORCH_DTYPES)}")
    return _TORCH_DTYPES[dtype]


def check_template(model_cfg: ModelConfig, hf_template: pathlib.Path) -> None:
    from sao_megatron.models.families import architecture_diff, model_config_from_hf

    diffs = architecture_diff(model_cfg, model_config_from_hf(hf_template))
    if diffs:
        raise ConversionError(f"{hf_template}/config.json does not describe the checkpoint's model: "
                              f"{'; '.join(diffs[:3])}")


def convert_mcore_to_hf(mcore_dir: str | pathlib.Path, out_dir: str | pathlib.Path, *,
                        hf_template: str | pathlib.Path | None = None, tp: int = 1, pp: int = 1, ep: int = 1,
                        etp: int | None = None, dtype: str | None = None, max_shard_bytes: int = 5 << 30,
                        bucket_bytes: int = 512 << 20,
                        overwrite: bool = False, progress: bool = True) -> pathlib.Path:
    """Export; returns the HF directory. Run under torchrun when tp*pp*ep > 1.

    ``etp``: tensor-parallel size inside the experts (None: ``tp``).
    """
    import torch.distributed as dist

    mcore_dir = pathlib.Path(mcore_dir)
    model_cfg = common.read_model_config(mcore_dir)
    template = pathlib.Path(hf_template) if hf_template else None
    if template is not None:
        check_template(model_cfg, template)
    out_dtype = output_dtype(model_cfg, template, dtype)
    out = common.check_output_dir(out_dir, overwrite=overwrite)
    common.check_launch(tp, pp, ep, etp)
    ctx, chunks = common.bootstrap(model_cfg, tp, pp, ep, etp=etp)
    common.load_megatron(mcore_dir, chunks)
    from sao_megatron.weights.export import ExportPlan, write_hf_weights

    plan = ExportPlan(chunks, get_family(model_cfg.family).weight_map(model_cfg), bucket_bytes=bucket_bytes)
    with common.atomic_output_dir(out, rank=ctx.rank, barrier=dist.barrier) as tmp:
        write_hf_weights(plan, tmp, dtype=out_dtype, max_shard_bytes=max_shard_bytes, progress=progress)
        if ctx.rank == 0:
            _write_side_files(tmp, model_cfg, template)
            mtp.append_to_hf(mcore_dir, tmp, out_dtype)
    return out


def _write_side_files(out: pathlib.Path, model_cfg: ModelConfig, template: pathlib.Path | None) -> None:
    if template is None:
        (out / "config.json").write_text(json.dumps(hf_config_from_model(model_cfg), indent=2) + "\n")
        return
    for path in template_files(template):
        shutil.copy2(path, out / path.name)
    if (out / "config.json").is_file():  # block-FP8 template: the export holds unquantized weights
        strip_quantization_config(out / "config.json")
