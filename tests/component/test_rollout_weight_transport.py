"""Disk transport: sharded safetensors loadable by the engine (the distributed transport is tested
against real engines in test_weight_sync_distributed.py)."""

from __future__ import annotations

import pytest
import torch
from rollout_fixtures import tiny_dirs  # noqa: F401 - fixture

from sao_megatron.weights.disk import write_hf_safetensors

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


def _copy_with(src, out, tensors):
    import shutil

    from safetensors.torch import save_file

    out.mkdir()
    shutil.copy2(src / "config.json", out / "config.json")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_disk_update_reads_straight_into_the_live_parameters(tiny_dirs, tmp_path):  # noqa: F811
    """The engine's disk load reads each tensor's bytes into its parameter range (converting where the
    dtypes differ): afterwards the live model equals transformers' own load of the same checkpoint."""
    from safetensors.torch import load_file

    from sao_megatron.rollout.engine.model import ModelRunner
    from sao_megatron.rollout.engine.weights import EngineWeights

    runner = ModelRunner(tiny_dirs["base"])
    weights = EngineWeights(runner)
    weights.read_into_live(weights.plan_checkpoint(tiny_dirs["other"]))
    reference = ModelRunner(tiny_dirs["other"]).model.state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in runner.model.state_dict().items())

    other = load_file(tiny_dirs["other"] / "model.safetensors")
    half = _copy_with(tiny_dirs["other"], tmp_path / "bf16", {n: t.to(torch.bfloat16) for n, t in other.items()})
    weights.read_into_live(weights.plan_checkpoint(half))
    rounded = {k: v.to(torch.bfloat16).float() for k, v in reference.items()}
    assert all(torch.equal(v, rounded[k]) for k, v in runner.model.state_dict().items())


def test_disk_update_checks_everything_before_touching_the_weights(tiny_dirs, tmp_path):  # noqa: F811
    from sao_megatron.rollout.engine.model import ModelRunner
    from sao_megatron.rollout.engine.weights import EngineWeights

    runner = ModelRunner(tiny_dirs["base"])
    weights = EngineWeights(runner)
    before = {k: v.clone() for k, v in runner.model.state_dict().items()}
    for bad, match in (("bad_names", "lm_head.weights"), ("bad_config", "differs from the served model")):
        with pytest.raises(ValueError, match=match):
            weights.plan_checkpoint(tiny_dirs[bad])
    assert all(torch.equal(v, before[k]) for k, v in runner.model.state_dict().items())
    short = tmp_path / "short"
    short.mkdir()
    (short / "config.json").write_bytes((tiny_dirs["other"] / "config.json").read_bytes())
    data = (tiny_dirs["other"] / "model.safetensors").read_bytes()
    (short / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(OSError, match="ends inside tensor"):
        weights.read_into_live(weights.plan_checkpoint(short))
