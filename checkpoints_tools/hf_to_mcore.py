"""HF safetensors -> Megatron distributed checkpoint (loadable at any parallel layout).

Every input check (config translation, shard presence and integrity, the
exact tensor set and shapes the config implies) runs before Megatron is
imported or anything is written. Each rank then builds its shard of the
model at ``--tp/--pp/--ep`` and copies in only the HF tensors it holds, one
tensor at a time from the memory-mapped shards (no second full copy).
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from collections import defaultdict
from dataclasses import dataclass

from sao_megatron.config.schema import ModelConfig
from sao_megatron.models.families import Family, WeightMap, family_for_hf
from sao_megatron.models.families.base import Entry
from sao_megatron.models.families.hf_config import read_hf_config
from sao_megatron.models.families.fp8 import open_checkpoint
from sao_megatron.models.families.hf_files import HfCheckpoint

from checkpoints_tools import common, mtp

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class HfSource:
    """A validated HF checkpoint and everything derived from it."""

    family: Family
    model_cfg: ModelConfig
    wmap: WeightMap
    ckpt: HfCheckpoint
    hf_config: dict


def open_hf(hf_dir: str | pathlib.Path, *, dtype: str | None = None, family: Family | None = None) -> HfSource:
    """Read and validate ``hf_dir`` (ConversionError on any mismatch); ``dtype`` overrides params_dtype."""
    hf_cfg = read_hf_config(hf_dir)
    source = str(pathlib.Path(hf_dir) / "config.json")
    fam = family or family_for_hf(hf_cfg, source)
    model_cfg = fam.config_from_hf(hf_cfg, source)
    if dtype:
        model_cfg = dataclasses.replace(model_cfg, params_dtype=dtype)
    wmap = fam.weight_map(model_cfg)
    ckpt = open_checkpoint(hf_dir, hf_cfg)  # block-FP8 weights read back dequantized
    ckpt.validate(fam, wmap)
    return HfSource(fam, model_cfg, wmap, ckpt, hf_cfg)


def mapping_table(src: HfSource) -> list[str]:
    """Dry-run report: one line per mapping rule (instances collapsed) with HF and Megatron shapes."""
    groups: dict[str, list[Entry]] = defaultdict(list)
    for e in src.wmap.entries:
        groups[e.rule.mcore].append(e)
    lines = [f"family {src.family.name}: {len(src.wmap.entries)} Megatron tensors <- "
             f"{len(src.wmap.hf_names())} HF tensors, dtype {src.model_cfg.params_dtype}"]
    for template, entries in groups.items():
        e = entries[0]
        hf = " + ".join(f"{h}{list(s)}" for h, s in zip(e.rule.hf, e.hf_shapes))
        lines.append(f"  {template} x{len(entries)}  <-[{e.transform}]-  {hf}")
    return lines


def convert_hf_to_mcore(hf_dir: str | pathlib.Path, out_dir: str | pathlib.Path, *, tp: int = 1, pp: int = 1,
                        ep: int = 1, etp: int | None = None, dtype: str | None = None, overwrite: bool = False,
                        family: Family | None = None, progress: bool = True) -> pathlib.Path:
    """Convert; returns the checkpoint directory. Run under torchrun when tp*pp*ep > 1.

    ``etp``: tensor-parallel size inside the experts (None: ``tp``).
    """
    import torch.distributed as dist

    src = open_hf(hf_dir, dtype=dtype, family=family)
    out = common.check_output_dir(out_dir, overwrite=overwrite)
    common.check_launch(tp, pp, ep, etp)
    ctx, chunks = common.bootstrap(src.model_cfg, tp, pp, ep, etp=etp)
    from sao_megatron.models.families.sharded import load_hf_weights

    load_hf_weights(chunks, src.wmap, src.ckpt, progress=progress and ctx.rank == 0)
    with common.atomic_output_dir(out, rank=ctx.rank, barrier=dist.barrier) as tmp:
        common.save_megatron(tmp, chunks)
        if ctx.rank == 0:
            info = {"source": str(pathlib.Path(hf_dir).resolve()), "family": src.family.name,
                    "architectures": src.hf_config.get("architectures"),
                    "layout": {"tp": tp, "pp": pp, "ep": ep, "etp": etp or tp}}
            common.write_metadata(tmp, src.model_cfg, info)
            mtp.save_aside(src.ckpt, src.model_cfg.num_layers, tmp)
    return out
