"""Disk transport: sharded safetensors loadable by the engine (the distributed transport is tested
against real engines in test_weight_sync_distributed.py)."""

from __future__ import annotations

import pytest
import torch
from rollout_fixtures import tiny_dirs  # noqa: F401 - fixture

from sao_megatron.rollout.weight_sync import write_hf_safetensors

pytestmark = pytest.mark.component


def test_sharded_checkpoint_loads_in_engine(tiny_dirs, tmp_path):  # noqa: F811
    from safetensors.torch import load_file

    from sao_megatron.rollout.engine.model import ModelRunner

    tensors = load_file(tiny_dirs["other"] / "model.safetensors")
    out = write_hf_safetensors(tensors.items(), tmp_path / "v000001", template_dir=tiny_dirs["base"],
                               max_shard_bytes=30_000)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()
    runner = ModelRunner(tiny_dirs["base"])
    model = runner.load_checked(out)
    reference = ModelRunner(tiny_dirs["other"]).model.state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
