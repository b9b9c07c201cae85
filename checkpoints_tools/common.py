"""Shared plumbing of the converters: layout bootstrap, atomic output dirs, checkpoint metadata.

A converted Megatron checkpoint directory holds the Megatron distributed
checkpoint (written by ``sao_megatron.training.run.checkpoint``) plus
``model_config.yaml`` (the derived ModelConfig, Megatron field names) and
``conversion.json`` (where it came from).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import shutil
from collections.abc import Iterator
from typing import Any

import yaml

from sao_megatron.config.loader import from_dict, to_dict
from sao_megatron.config.schema import ModelConfig, ParallelConfig
from sao_megatron.models.families import ConversionError

MODEL_CONFIG = "model_config.yaml"
CONVERSION_INFO = "conversion.json"


def parallel_config(model_cfg: ModelConfig, tp: int, pp: int, ep: int, etp: int | None = None) -> ParallelConfig:
    """The layout a converter runs at (MoE with TP needs sequence parallelism); ``etp``: expert-TP (None = TP)."""
    moe = model_cfg.num_moe_experts is not None
    return ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                          sequence_parallel=moe and tp > 1, use_distributed_optimizer=False)


def check_launch(tp: int, pp: int, ep: int, etp: int | None = None) -> None:
    """Fail early (before importing Megatron) when the layout needs more processes than launched."""
    import math
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    etp = tp if etp is None else etp
    need = math.lcm(tp * pp, etp * ep * pp)
    if min(tp, pp, ep, etp) < 1 or world % need:
        raise ConversionError(f"--tp {tp} --pp {pp} --ep {ep} --etp {etp} needs a multiple of {need} processes, "
                              f"got {world}: launch with `torchrun --nproc-per-node {need} -m sao_megatron.cli "
                              "convert ...`")


def bootstrap(model_cfg: ModelConfig, tp: int, pp: int, ep: int, *, etp: int | None = None, seed: int = 0):
    """torch.distributed + Megatron parallel state + this rank's model chunks: (ctx, chunks)."""
    from sao_megatron.models.builder import build_model_chunks
    from sao_megatron.parallel.bootstrap import init_distributed

    ctx = init_distributed(parallel_config(model_cfg, tp, pp, ep, etp), seed=seed)
    chunks = build_model_chunks(model_cfg, ctx)
    for chunk in chunks:
        chunk.eval()
    return ctx, chunks


def check_output_dir(out_dir: str | pathlib.Path, *, overwrite: bool) -> pathlib.Path:
    out = pathlib.Path(out_dir).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ConversionError(f"{out}: exists and is not empty; choose a new output directory or pass --overwrite")
    return out


@contextlib.contextmanager
def atomic_output_dir(out: pathlib.Path, *, rank: int = 0, barrier=None) -> Iterator[pathlib.Path]:
    """Yield a temporary sibling of ``out``; on success it replaces ``out``, on error it is removed.

    All ranks get the same path (it depends only on ``out``); rank 0 creates, renames and cleans up;
    ``barrier`` (a no-arg callable) separates those steps from the other ranks' writes.
    """
    barrier = barrier or (lambda: None)
    tmp = out.parent / f".{out.name}.converting"
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier()
    try:
        yield tmp
        barrier()
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if rank == 0:
        if out.exists():
            old = out.parent / f".{out.name}.replaced"
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(out)
    barrier()


def write_metadata(ckpt_dir: pathlib.Path, model_cfg: ModelConfig, info: dict[str, Any]) -> None:
    (ckpt_dir / MODEL_CONFIG).write_text(yaml.safe_dump(to_dict(model_cfg), sort_keys=False))
    (ckpt_dir / CONVERSION_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def read_model_config(ckpt_dir: str | pathlib.Path) -> ModelConfig:
    """The ModelConfig stored beside a converted Megatron checkpoint."""
    path = pathlib.Path(ckpt_dir) / MODEL_CONFIG
    if not path.is_file():
        raise ConversionError(f"{path}: not found; --mcore-dir must be a directory written by "
                              "`sao-megatron convert hf-to-mcore` (or hold a model_config.yaml)")
    return from_dict(ModelConfig, yaml.safe_load(path.read_text()), source=str(path))


def save_megatron(ckpt_dir: pathlib.Path, chunks: list) -> None:
    """Write the model chunks as a Megatron distributed checkpoint (collective)."""
    from sao_megatron.training.run import checkpoint

    checkpoint.save_checkpoint(ckpt_dir, chunks)


def load_megatron(ckpt_dir: pathlib.Path, chunks: list) -> None:
    """Load a Megatron distributed checkpoint into the model chunks at their layout (collective)."""
    from sao_megatron.training.run import checkpoint

    checkpoint.load_checkpoint(ckpt_dir, chunks)
