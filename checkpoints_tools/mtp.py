"""Multi-token-prediction (MTP) layers of DeepSeek-V3 / GLM-5 checkpoints: kept aside, written back unchanged.

The HF checkpoints store ``num_nextn_predict_layers`` MTP layers as
``model.layers.{num_hidden_layers + i}.*``. They are not part of the Megatron
model (RL trains the next-token policy only; ModelConfig.mtp_num_layers records
them), so ``hf-to-mcore`` copies them verbatim into ``mtp_layers.safetensors``
beside the Megatron checkpoint and ``mcore-to-hf`` adds them back as one more
shard: HF -> Megatron -> HF stays bit-exact. An engine that drafts with the MTP
layer (speculative decoding) keeps the initial MTP weights during RL: the
weight sync sends the trained main model only, and speculative decoding's
acceptance test keeps the sampled distribution the main model's, so a stale
draft costs acceptance rate, never correctness.
"""

from __future__ import annotations

import json
import pathlib
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file

MTP_FILE = "mtp_layers.safetensors"
MTP_SHARD = "model-mtp.safetensors"
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def mtp_tensor_names(names: list[str], num_layers: int) -> list[str]:
    """HF tensor names that belong to layers >= ``num_layers`` (the MTP layers)."""
    return [n for n in names if (m := _LAYER.match(n)) and int(m.group(1)) >= num_layers]


def save_aside(ckpt, num_layers: int, ckpt_dir: pathlib.Path) -> int:
    """Copy the MTP tensors of ``ckpt`` (HfCheckpoint) into ``ckpt_dir/MTP_FILE``; returns their count."""
    names = mtp_tensor_names(ckpt.keys(), num_layers)
    if names:
        save_file({n: ckpt.get(n).contiguous() for n in names}, str(ckpt_dir / MTP_FILE), metadata={"format": "pt"})
    return len(names)


def append_to_hf(mcore_dir: pathlib.Path, hf_dir: pathlib.Path, dtype: torch.dtype | None) -> int:
    """Add the kept-aside MTP tensors to an exported HF directory (one more shard + index entries).

    ``dtype`` casts floating tensors (None keeps them); returns the number of tensors added.
    """
    src = pathlib.Path(mcore_dir) / MTP_FILE
    if not src.is_file():
        return 0
    with safe_open(str(src), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if dtype is not None:
        tensors = {k: t.to(dtype) if t.is_floating_point() else t for k, t in tensors.items()}
    save_file(tensors, str(hf_dir / MTP_SHARD), metadata={"format": "pt"})
    index_path = hf_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update(dict.fromkeys(tensors, MTP_SHARD))
    index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in tensors.values())
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return len(tensors)
