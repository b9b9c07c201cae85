"""Weight publishing against a real SGLang 0.5.23 server: both transports advance the version the
client expects (and a retry's health() keeps the engine), bf16 weights with a vocabulary that is not a
multiple of 64 verify by checksum, an update session interrupted mid-push is ended and the next push
succeeds, and the reply to aborting a queued request parses as an abort."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch

from sao_megatron.rollout.client import RolloutClient
from sao_megatron.rollout.protocol import build_generate_payload, parse_generate_reply
from sao_megatron.weights.readmission import CurrentWeights
from sao_megatron.rollout.types import SamplingParams
from sao_megatron.weights.disk import DiskWeightSync
from sao_megatron.weights.distributed import DistributedWeightSync

pytestmark = pytest.mark.sglang


def _weights(server, scale: float) -> list[tuple[str, torch.Tensor]]:
    """The server's checkpoint with every tensor scaled (new weights, same dtype and names)."""
    from safetensors.torch import load_file

    named = [(n, t) for f in sorted(server.model_dir.glob("*.safetensors")) for n, t in load_file(f).items()]
    return [(n, (t.float() * scale).to(t.dtype)) for n, t in named]


def _distributed(server) -> DistributedWeightSync:
    sync = DistributedWeightSync(backend="gloo", master_address="127.0.0.1", api_key=server.api_key, verify=True,
                                 strict_names=False, checkpoint_dtype=server.dtype.replace("bf16", "bfloat16")
                                 .replace("fp32", "float32"), bucket_bytes=1 << 20, timeout_s=120)
    sync.connect([server.url], is_sender=True)
    return sync


def _disk(server, client, root) -> DiskWeightSync:
    sync = DiskWeightSync(client=client, sync_root=root, template_dir=server.model_dir, collective=False,
                          verify=True, api_key=server.api_key, timeout_s=120, strict_names=False,
                          checkpoint_dtype=server.dtype.replace("bf16", "bfloat16").replace("fp32", "float32"))
    sync.connect([server.url], is_sender=True)
    return sync


def _served_version(server) -> str:
    return httpx.get(server.url + "/model_info", headers=server.headers, trust_env=False).json()["weight_version"]


def test_versions_advance_across_disk_and_distributed_pushes_and_health_keeps_the_engine(
        start_sglang_server, tmp_path):
    """bf16 weights, vocabulary 250: each push is verified against the engine's own checksums, the
    engine serves its version, and the client's health probe (expecting the served record) keeps it."""
    server = start_sglang_server("bf16")
    served = CurrentWeights(server.model_dir, 0)

    async def run():
        client = RolloutClient([server.url], api_key=server.api_key, served=served)
        disk = _disk(server, client, tmp_path / "weights")
        dist_sync = _distributed(server)
        try:
            out = await asyncio.to_thread(dist_sync.push, _weights(server, 1.5), 1)
            assert out["weight_sync/verified"] == 1 and out["weight_sync/unverified_engines"] == 0, out
            served.set(None, 1)
            assert _served_version(server) == "1"
            assert await client.health() == {server.url: True} and client.healthy_urls() == [server.url]

            loop = asyncio.get_running_loop()  # the client's loop runs the load (as the scheduler's pause does)
            paused = lambda update: asyncio.run_coroutine_threadsafe(update(), loop).result()  # noqa: E731
            out = await asyncio.to_thread(disk.push, _weights(server, 0.5), 2, paused=paused)
            assert out["weight_sync/verified"] == 1, out
            served.set(None, 2)
            assert _served_version(server) == "2"
            assert await client.health() == {server.url: True} and client.healthy_urls() == [server.url]

            served.set(None, 0)  # a client expecting another version keeps the engine out (the old defect)
            await client.health()
            assert client.healthy_urls() == []
        finally:
            dist_sync.close()
            disk.close()
            await client.aclose()
    asyncio.run(run())


def test_an_update_session_interrupted_mid_push_is_ended_and_the_next_push_succeeds(start_sglang_server):
    server = start_sglang_server("fp32")
    sync = _distributed(server)
    try:
        def broken():
            yield from _weights(server, 1.25)[:3]
            raise RuntimeError("export failed mid-push")
        with pytest.raises(RuntimeError, match="mid-push"):
            sync.push(broken(), 1)
        # SGLang refuses a second begin while a session is open: the session must have ended
        r = httpx.post(server.url + "/begin_weight_update", json={}, headers=server.headers, trust_env=False)
        assert r.status_code == 200, r.text
        assert httpx.post(server.url + "/end_weight_update", json={}, headers=server.headers,
                          trust_env=False).status_code == 200
        out = sync.push(_weights(server, 1.25), 2, verify=True)
        assert out["weight_sync/verified"] == 1 and _served_version(server) == "2"
    finally:
        sync.close()


def test_aborting_a_queued_request_answers_without_prompt_tokens_and_parses_as_an_abort(sglang_server):
    """A running request retracted by a pause goes back to SGLang's waiting queue with its output;
    aborting it there answers 200 without prompt_tokens or routed_experts
    (``scheduler.py:abort_request`` pops it from ``waiting_queue``; ``tokenizer_manager._handle_abort_req``
    answers), and our parser takes it as an abort."""
    server = sglang_server

    def post(path, body):
        return httpx.post(server.url + path, json=body, headers=server.headers, timeout=300, trust_env=False)
    sampling = SamplingParams(max_new_tokens=400, temperature=1.0, ignore_eos=True)
    payload = build_generate_payload([5, 6, 7, 8], sampling, rid="queued-1", return_routed_experts=True)
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(reply=post("/generate", payload)))
    thread.start()
    try:
        time.sleep(0.5)  # decoding
        assert post("/pause_generation", {"mode": "retract"}).status_code == 200  # back to the waiting queue
        assert post("/abort_request", {"rid": "queued-1"}).status_code == 200
        thread.join(60)
    finally:
        post("/continue_generation", {})
        thread.join(120)
    reply = box["reply"]
    assert reply.status_code == 200, reply.text
    body = reply.json()
    meta = body["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and "prompt_tokens" not in meta, meta
    assert "routed_experts" not in meta and len(body["output_ids"]) < 400
    kept = parse_generate_reply(body, rid="queued-1", engine_url=server.url, latency_s=0.0, prompt_len=4)
    assert kept.finish_reason == "abort" and kept.output_ids == body["output_ids"] and kept.prompt_tokens == 4
    assert kept.versions == [0] * len(kept.output_ids)
    routed = parse_generate_reply(body, rid="queued-1", engine_url=server.url, latency_s=0.0, prompt_len=4,
                                  want_routed_experts=True, routed_experts_layout=(2, 2))
    assert routed.output_ids == [] and routed.routed_experts.shape == (0, 2, 2)
