"""Bucket planning and the atomic sharded safetensors writer (files only, no model)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from sao_megatron.rollout.weight_sync import TensorMeta, plan_buckets, write_hf_safetensors

pytestmark = pytest.mark.unit


def _reference_buckets(sizes: list[int], cap: int) -> list[list[int]]:
    """Greedy consecutive packing, written the slow obvious way (indices)."""
    out: list[list[int]] = []
    for i, s in enumerate(sizes):
        if out and sum(sizes[j] for j in out[-1]) + s <= cap:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def test_plan_buckets_matches_reference():
    rng = random.Random(0)
    for _ in range(100):
        sizes = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 40))]
        cap = rng.randrange(50, 1000)
        metas = [TensorMeta(f"t{i}", "float32", (s,), s) for i, s in enumerate(sizes)]
        got = [[int(m.name[1:]) for m in bucket] for bucket in plan_buckets(metas, cap)]
        assert got == _reference_buckets(sizes, cap)
    with pytest.raises(ValueError):
        plan_buckets([], 0)


def test_tensor_meta_names_sglang_dtypes():
    assert TensorMeta.of("w", torch.zeros(2, 3, dtype=torch.bfloat16)) == TensorMeta("w", "bfloat16", (2, 3), 12)


def _tensors(n: int = 12) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(f"layer.{i}.weight", torch.randn(10 + i, 8, generator=gen)) for i in range(n)]


def test_sharded_write_roundtrip(tmp_path):
    tensors = _tensors()
    template = tmp_path / "template"
    template.mkdir()
    (template / "config.json").write_text("{}")
    (template / "tokenizer.json").write_text("{}")
    (template / "model.safetensors").write_bytes(b"stale weights must not be copied")
    out = write_hf_safetensors(tensors, tmp_path / "ckpt", template_dir=template, max_shard_bytes=2000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 3 and set(index["weight_map"].values()) == set(shards)
    assert shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    loaded = {}
    for shard in shards:
        part = load_file(out / shard)
        assert all(index["weight_map"][k] == shard for k in part)
        loaded.update(part)
    assert set(loaded) == {n for n, _ in tensors}
    assert all(torch.equal(loaded[n], t) for n, t in tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for _, t in tensors)
    assert {p.name for p in out.iterdir()} == set(shards) | {"model.safetensors.index.json", "config.json",
                                                             "tokenizer.json"}


def test_single_shard_and_atomic_replace(tmp_path):
    out = write_hf_safetensors(_tensors(2), tmp_path / "ckpt")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    # a view sharing storage with another tensor is written as its own data
    base = torch.arange(12.0)
    write_hf_safetensors([("a", base), ("b", base[:6].view(2, 3))], tmp_path / "ckpt")
    got = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert torch.equal(got["b"], torch.arange(6.0).view(2, 3)) and set(got) == {"a", "b"}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary or old directories left


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="twice"):
        write_hf_safetensors([("a", torch.ones(2)), ("a", torch.ones(2))], tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []
