"""Bucket planning of the distributed sync and the atomic sharded safetensors writer (files only, no model)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from sao_megatron.models.families.hf_files import write_sharded
from sao_megatron.weights.disk import DiskWeightSync, write_hf_safetensors
from sao_megatron.weights.distributed import _buckets

pytestmark = pytest.mark.unit


def _reference_buckets(items: list[tuple[str, int, str]], cap: int) -> list[list[str]]:
    """Per dtype, greedy consecutive packing up to ``cap`` bytes, written the slow obvious way."""
    out: list[list[str]] = []
    for dtype in dict.fromkeys(d for _, _, d in items):
        mine = [(n, s) for n, s, d in items if d == dtype]
        groups: list[list[tuple[str, int]]] = []
        for n, s in mine:
            if groups and sum(x for _, x in groups[-1]) + s <= cap:
                groups[-1].append((n, s))
            else:
                groups.append([(n, s)])
        out += [[n for n, _ in g] for g in groups]
    return out


def test_buckets_one_dtype_each_match_reference():
    rng = random.Random(0)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    for _ in range(100):
        items = [(f"t{i}", rng.randrange(1, 300), rng.choice(list(dtypes))) for i in range(rng.randrange(1, 30))]
        cap = rng.randrange(50, 1500)
        named = [(n, torch.zeros(s, dtype=dtypes[d])) for n, s, d in items]
        got = [[n for n, _ in b] for b in _buckets(named, cap)]
        sizes = {n: s * dtypes[d].itemsize for n, s, d in items}
        want = _reference_buckets([(n, sizes[n], d) for n, _, d in items], cap)
        assert sorted(got) == sorted(want)  # same buckets; the stream order differs across dtypes
        assert all(len({named[int(n[1:])][1].dtype for n in b}) == 1 for b in got)


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


def test_exports_conversions_and_the_disk_sync_write_one_format(tmp_path):
    """One shard writer: an export (write_hf_safetensors), a conversion (write_sharded) and a disk push
    (DiskWeightSync.write) of the same tensors give byte-identical files: each shard is what
    safetensors.save_file writes for the greedy grouping (made here the slow obvious way), under HF's
    model-0000i-of-0000n names, with the same index."""
    tensors, cap = _tensors(), 2000
    groups: list[dict[str, torch.Tensor]] = []
    for name, t in tensors:
        if not groups or sum(x.numel() * 4 for x in groups[-1].values()) + t.numel() * 4 > cap:
            groups.append({})
        groups[-1][name] = t
    ref = tmp_path / "ref"
    ref.mkdir()
    for i, group in enumerate(groups):
        save_file(group, str(ref / f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"), metadata={"format": "pt"})
    export = write_hf_safetensors(tensors, tmp_path / "export", max_shard_bytes=cap)
    converted = tmp_path / "converted"
    converted.mkdir()
    write_sharded(tensors, converted, max_shard_bytes=cap, dtype_of=lambda name: None)
    sync = DiskWeightSync(client=None, sync_root=tmp_path / "sync", template_dir=None, collective=False,
                          max_shard_bytes=cap)
    pushed, _ = sync.write(tensors, 1)
    sync.close()
    index = (export / "model.safetensors.index.json").read_bytes()
    assert json.loads(index) == {"metadata": {"total_size": sum(t.numel() * 4 for _, t in tensors)},
                                 "weight_map": {n: p.name for p in ref.iterdir() for n in load_file(p)}}
    for out in (export, converted, pushed):
        assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(p.name for p in ref.iterdir()), out
        assert all((out / p.name).read_bytes() == p.read_bytes() for p in ref.iterdir()), out
        assert (out / "model.safetensors.index.json").read_bytes() == index, out


def test_engines_with_data_parallel_attention_are_refused_with_the_reason():
    import httpx

    from sao_megatron.weights.distributed import DistributedWeightSync, WeightSyncError

    infos = {"a": {"tp_size": 4, "dp_size": 1}, "b": {"tp_size": 8, "dp_size": 8}}
    sync = DistributedWeightSync(backend="gloo", master_address="127.0.0.1")
    sync.http = httpx.Client(transport=httpx.MockTransport(lambda req: httpx.Response(200, json=infos[req.url.host])))
    assert [(url, tp) for url, tp, _ in sync._engine_layout(["http://a/"])] == [("http://a", 4)]
    reason = sync._engine_layout(["http://a", "http://b"])
    assert "dp_size=8" in reason and "rollout.weight_sync.transport=disk" in reason
    with pytest.raises(WeightSyncError, match="dp_size=8"):
        sync.connect(["http://b"], is_sender=True)


def test_flattened_bucket_layout_is_sglangs():
    """Back-to-back bytes; a tensor at an offset that is not a multiple of its size is refused."""
    from sao_megatron.rollout.update_group import flatten_bucket, unflatten_bucket

    a, b = torch.arange(6, dtype=torch.float32).view(2, 3), torch.tensor([7, 8], dtype=torch.int64)
    buf = flatten_bucket([a, b])
    assert buf.dtype == torch.uint8 and buf.numel() == 24 + 16
    got = unflatten_bucket(buf, [torch.float32, torch.int64], [[2, 3], [2]])
    assert torch.equal(got[0], a) and torch.equal(got[1], b)
    with pytest.raises(ValueError, match="unaligned"):
        unflatten_bucket(torch.zeros(10, dtype=torch.uint8), [torch.bfloat16, torch.float32], [[1], [2]])


def test_group_store_address_is_on_the_route_to_the_engines():
    """Each sender hosts its update group's store where the engines can dial it: loopback engines get
    loopback, engines reached over an interface get that interface's address (not whatever the
    hostname resolves to)."""
    import socket
    import subprocess

    from sao_megatron.weights.distributed import address_towards

    assert address_towards("127.0.0.1") == "127.0.0.1"
    own = [a for a in subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
           if "." in a and not a.startswith("127.")]
    for addr in own:  # an address of this host is reached from itself, not via loopback's 127.0.0.1
        assert address_towards(addr) == addr
    assert address_towards(socket.gethostname()) != ""
