"""Weight transports: sharded safetensors loadable by the engine, and the bucketed broadcast
(gloo on CPU here; NCCL on GPUs in the gpu-marked test) received by an engine stand-in process."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest
import torch
from rollout_fixtures import broadcast_receiver, sync_tensors, tiny_dirs  # noqa: F401 - fixture

from sao_megatron.net import free_port
from sao_megatron.rollout.weight_sync import NcclWeightSync, write_hf_safetensors

pytestmark = pytest.mark.component


class AnnouncingClient:
    """The RolloutClient calls NcclWeightSync makes, forwarded to the receiver process."""

    def __init__(self, meta_q):
        self.meta_q = meta_q
        self.calls: list[dict] = []

    async def engine_world_sizes(self):
        return [1]

    async def init_weights_update_group(self, *args, **kwargs):
        return 2

    async def update_weights_from_distributed(self, names, dtypes, shapes, *, group_name, weight_version, flush_cache):
        call = {"names": names, "dtypes": dtypes, "shapes": shapes, "version": weight_version, "flush": flush_cache}
        self.calls.append(call)
        self.meta_q.put(call)

    async def destroy_weights_update_group(self, group_name):
        self.meta_q.put(None)


def run_broadcast(backend: str, device: str, bucket_bytes: int) -> tuple[str, list[dict], dict]:
    ctx = mp.get_context("spawn")
    meta_q, result_q = ctx.Queue(), ctx.Queue()
    port = free_port()
    child = ctx.Process(target=broadcast_receiver, args=(backend, port, device, 7, meta_q, result_q), daemon=True)
    child.start()
    client = AnnouncingClient(meta_q)
    sync = NcclWeightSync(client, master_address="127.0.0.1", master_port=port, bucket_bytes=bucket_bytes,
                          backend=backend, device=device)

    async def go():
        await sync.connect()
        metrics = await sync.push(sync_tensors(7), version=3)
        await sync.close()
        return metrics
    try:
        metrics = asyncio.run(asyncio.wait_for(go(), 180))
        status, _ = result_q.get(timeout=120)
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    return status, client.calls, metrics


def test_bucketed_broadcast_gloo():
    bucket_bytes = 10_000
    status, calls, metrics = run_broadcast("gloo", "cpu", bucket_bytes)
    assert status == "ok"
    expected = sync_tensors(7)
    assert [n for c in calls for n in c["names"]] == [n for n, _ in expected]  # order kept across buckets
    sizes = {n: t.numel() * t.element_size() for n, t in expected}
    for c in calls:
        total = sum(sizes[n] for n in c["names"])
        assert total <= bucket_bytes or len(c["names"]) == 1  # an oversize tensor travels alone
    assert [c["version"] for c in calls] == [None] * (len(calls) - 1) + [3]  # version + flush on the last only
    assert [c["flush"] for c in calls] == [False] * (len(calls) - 1) + [True]
    assert len(calls) >= 3 and metrics["weight_sync/buckets"] == len(calls)
    assert metrics["weight_sync/bytes"] == sum(sizes.values())


@pytest.mark.gpu
def test_bucketed_broadcast_gpu():
    """NCCL needs one GPU per rank; on a single-GPU machine the CUDA tensors go through gloo."""
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    device = f"cuda:{torch.cuda.device_count() - 1}"
    status, calls, _ = run_broadcast(backend, device, 10_000)
    assert status == "ok" and len(calls) >= 3


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
