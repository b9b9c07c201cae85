"""The weight publisher's SGLang 0.5.23 rules, each against what SGLang's source does (issue 23's defects):
checksums of what the engine holds, update sessions that always end, disk loads outside sessions,
the waiting-queue abort reply, and the verified metric at tp > 1."""

from __future__ import annotations

import asyncio
import hashlib

import httpx
import pytest
import torch

from sao_megatron.rollout.protocol import parse_generate_reply
from sao_megatron.rollout.weight_check import EngineHolding, compare_checksums, expected_checksums

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- checksums
def _sglang_tensor_hash(t: torch.Tensor) -> str:
    """``srt/managers/mm_utils.py:tensor_hash`` for a CPU tensor, formatted as ``_hash_tensor`` does."""
    t = t.detach().cpu().contiguous()
    digest = hashlib.sha256(memoryview(t.reshape(-1).view(torch.uint8).numpy())).digest()[:8]
    return f"{int.from_bytes(digest, byteorder='big', signed=False):016x}"


def _sglang_holds(name: str, loaded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What SGLang's parameter holds after loading ``loaded``: allocated in the model dtype
    (``set_default_torch_dtype``), vocabulary rows padded to 64 (``pad_vocab_size``), loaded rows copied
    and the padding zeroed (``VocabParallelEmbedding.weight_loader``)."""
    rows = loaded.shape[0]
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        rows = (rows + 63) // 64 * 64
    param = torch.empty((rows, *loaded.shape[1:]), dtype=dtype)
    param[: loaded.shape[0]].copy_(loaded)
    param[loaded.shape[0]:].fill_(0)
    return param


@pytest.mark.parametrize("engine_dtype, sent", [("auto", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                                ("auto", torch.float32), ("float32", torch.bfloat16)])
def test_checksums_match_what_sglang_holds_with_an_odd_vocabulary(engine_dtype, sent):
    """bf16 parameters and a vocabulary of 1000 rows (not a multiple of 64): the expected checksums equal
    SGLang's of what it holds; the bytes as sent do not (the check before this fix)."""
    g = torch.Generator().manual_seed(0)
    named = [("model.embed_tokens.weight", torch.randn(1000, 8, generator=g).to(sent)),
             ("lm_head.weight", torch.randn(1000, 8, generator=g).to(sent)),
             ("model.norm.weight", torch.randn(8, generator=g).to(sent))]
    info = {"version": "0.5.23", "tp_size": 1, "device": "cpu", "dtype": engine_dtype, "quantization": None}
    holding = EngineHolding.from_server_info(info, checkpoint_dtype=str(sent).removeprefix("torch."))
    held_dtype = {"auto": torch.float16 if sent == torch.float32 else sent}.get(engine_dtype) or \
        getattr(torch, engine_dtype)
    engine = {n: _sglang_tensor_hash(_sglang_holds(n, t, held_dtype)) for n, t in named}
    assert compare_checksums(expected_checksums(named, holding), engine, where="engine") == 3
    with pytest.raises(Exception, match="differ"):
        compare_checksums(expected_checksums(named), engine, where="engine")  # bytes as sent


def test_engines_whose_checksums_cannot_be_reproduced_are_named_unverifiable():
    base = {"version": "0.5.23", "tp_size": 1, "device": "cpu", "dtype": "bfloat16"}
    assert EngineHolding.from_server_info(base, checkpoint_dtype="bfloat16").unverifiable is None
    assert "tp_size=2" in EngineHolding.from_server_info(base | {"tp_size": 2}, checkpoint_dtype=None).unverifiable
    assert "Triton" in EngineHolding.from_server_info(base | {"device": "cuda"}, checkpoint_dtype=None).unverifiable
    assert "FP8" in EngineHolding.from_server_info(base, checkpoint_dtype=None, quantized=True).unverifiable
    embedded = EngineHolding.from_server_info({"version": "0.5.23+sao-embedded"}, checkpoint_dtype="bfloat16")
    assert embedded.dtype == torch.float32 and embedded.vocab_padding == 1


class _Engines:
    """HTTP replies of SGLang engines (MockTransport); records every call as (host, path)."""

    def __init__(self, tp_size: int = 1, fail_on: str | None = None):
        self.calls: list[tuple[str, str]] = []
        self.tp_size, self.fail_on = tp_size, fail_on

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append((request.url.host, request.url.path))
        if request.url.path == self.fail_on:
            return httpx.Response(500, json={"success": False, "message": "boom"})
        if request.url.path == "/weights_checker":
            return httpx.Response(200, json={"success": True, "ranks": [
                {"checksums": {}, "parallelism_info": [{"tp_rank": r, "tp_size": self.tp_size}]}
                for r in range(self.tp_size)]})
        return httpx.Response(200, json={"success": True, "message": "Success"})


def test_tp2_engines_are_reported_unverified():
    """At engine tp > 1 the checksums are of shards: the push says so (verified 0, one unverified
    engine) instead of reporting it verified."""
    from sao_megatron.weights.distributed import DistributedWeightSync, EngineLink

    sync = DistributedWeightSync(backend="gloo", master_address="127.0.0.1")
    sync.http = httpx.Client(transport=httpx.MockTransport(_Engines(tp_size=2)))
    info = {"version": "0.5.23", "tp_size": 2, "device": "cpu", "dtype": "bfloat16"}
    sync.links = [EngineLink(0, "http://a", 2, EngineHolding.from_server_info(info, checkpoint_dtype=None))]
    unverified = sync._verify(sync.links, {})
    assert (unverified.engines, unverified.tensors) == (1, 0)
    metrics = sync._metrics([_stats()], _stats(), unverified)
    assert metrics["weight_sync/verified"] == 0 and metrics["weight_sync/unverified_engines"] == 1


def _stats():
    from sao_megatron.weights.distributed import _SenderStats

    return _SenderStats()


# ---------------------------------------------------------------- sessions
def test_a_push_that_fails_mid_stream_still_ends_the_update_session():
    """SGLang refuses /begin_weight_update while a session is open
    (``scheduler_components/weight_updater.py:begin_weight_update``): an exception between begin and
    end must end the session, or the engine is locked out of every later push."""
    from sao_megatron.weights.distributed import DistributedWeightSync, EngineLink

    engines = _Engines()
    sync = DistributedWeightSync(backend="gloo", master_address="127.0.0.1")
    sync.http = httpx.Client(transport=httpx.MockTransport(engines))
    sync.links = [EngineLink(0, "http://a", 1), EngineLink(1, "http://b", 1)]

    def owned():
        yield "model.norm.weight", torch.ones(4)
        raise RuntimeError("export failed")
    with pytest.raises(RuntimeError, match="export failed"):
        sync.push(owned(), 1)
    paths = [(h, p) for h, p in engines.calls if "weight_update" in p]
    assert sorted(paths) == [("a", "/begin_weight_update"), ("a", "/end_weight_update"),
                             ("b", "/begin_weight_update"), ("b", "/end_weight_update")]


class _RecordingClient:
    def __init__(self):
        self.calls: list[str] = []

    def healthy_urls(self):
        return []

    def __getattr__(self, name):
        async def call(*args, **kwargs):
            self.calls.append(name)
        return call


def test_disk_pushes_are_not_wrapped_in_an_update_session(tmp_path):
    """SGLang's disk path restores, loads and post-processes the weights itself and never marks the
    session loaded, so a session around it would post-process twice at /end_weight_update
    (``run_post_load = not self._session.loaded_weights``)."""
    from sao_megatron.weights.disk import DiskWeightSync

    client = _RecordingClient()
    sync = DiskWeightSync(client=client, sync_root=tmp_path, template_dir=None, collective=False, verify=False)
    sync.push([("model.norm.weight", torch.ones(4))], 1)
    assert client.calls == ["update_weights_from_disk"]


# ---------------------------------------------------------------- aborts
def _queued_abort_reply(rid: str, *, output_ids: list[int], version: str = "3") -> dict:
    """SGLang 0.5.23's reply to a request aborted in its waiting queue, built as
    ``tokenizer_manager.py:_handle_abort_req`` builds it (return_logprob=True, skip_tokenizer_init)."""
    meta = {"id": rid, "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "weight_version": version, "e2e_latency": 0.01}
    meta["weight_versions"] = [{"version": version, "start": 0, "end": len(output_ids)}]  # add_weight_versions_to_meta_info
    meta["input_token_logprobs"] = []
    meta["output_token_logprobs"] = [[-0.5, t, None] for t in output_ids]  # add_logprob_to_meta_info
    meta["output_token_logprobs_length"] = len(output_ids)
    meta["completion_tokens"] = len(output_ids)
    return {"text": "", "output_ids": output_ids, "meta_info": meta}


def test_the_waiting_queue_abort_reply_is_an_abort_not_a_malformed_reply():
    """No prompt_tokens and no routed_experts: still a plain abort the episode resubmits."""
    reply = _queued_abort_reply("r1", output_ids=[])
    res = parse_generate_reply(reply, rid="r1", engine_url="http://a", latency_s=0.0, prompt_len=5,
                               want_routed_experts=True, routed_experts_layout=(2, 2))
    assert res.finish_reason == "abort" and res.output_ids == [] and res.prompt_tokens == 5
    assert res.routed_experts is not None and res.routed_experts.shape == (0, 2, 2)


def test_a_retracted_request_aborted_in_the_queue_keeps_its_tokens_unless_routes_are_needed():
    reply = _queued_abort_reply("r2", output_ids=[7, 8, 9])
    kept = parse_generate_reply(reply, rid="r2", engine_url="http://a", latency_s=0.0, prompt_len=4)
    assert kept.output_ids == [7, 8, 9] and kept.versions == [3, 3, 3] and kept.logprobs == [-0.5] * 3
    # their routes are unknown: dropped, regenerated (with their routes) by the resubmitted request
    dropped = parse_generate_reply(reply, rid="r2", engine_url="http://a", latency_s=0.0, prompt_len=4,
                                   want_routed_experts=True, routed_experts_layout=(2, 2))
    assert dropped.output_ids == [] and dropped.logprobs == [] and dropped.routed_experts.shape == (0, 2, 2)


def test_an_episode_whose_request_is_aborted_in_the_queue_is_resubmitted():
    """The episode resubmits and finishes; its group is not abandoned."""
    from sao_megatron.config.schema import SchedulerConfig
    from sao_megatron.envs import ArithmeticTask
    from sao_megatron.rollout.client import RolloutClient
    from sao_megatron.rollout.types import SamplingParams
    from sao_megatron.scheduler import AsyncScheduler

    replies = []

    def engine(request: httpx.Request) -> httpx.Response:
        import json
        body = json.loads(request.content)
        if len(replies) == 0:
            replies.append("aborted")
            return httpx.Response(200, json=_queued_abort_reply(body["rid"], output_ids=[], version="0"))
        replies.append("done")
        out = [1, 2]
        meta = {"id": body["rid"], "finish_reason": {"type": "length", "length": 2}, "prompt_tokens":
                len(body["input_ids"]), "weight_version": "0", "output_token_logprobs": [[-0.1, t, None] for t in out],
                "weight_versions": [{"version": "0", "start": 0, "end": 2}]}
        return httpx.Response(200, json={"text": "", "output_ids": out, "meta_info": meta})

    async def run():
        client = RolloutClient(["http://e"])
        client._http = httpx.AsyncClient(transport=httpx.MockTransport(engine))
        cfg = SchedulerConfig(mode="single", batch_size=1, concurrency=1, max_staleness=1)
        s = AsyncScheduler(client, ArithmeticTask(num_prompts=4), cfg, SamplingParams(max_new_tokens=2),
                           reward_workers=1, retry_backoff_s=0.01)
        await s.start()
        batch = await asyncio.wait_for(s.next_batch(1), 30)
        await s.stop()
        return batch, s.metrics()
    batch, metrics = asyncio.run(run())
    assert replies[:2] == ["aborted", "done"]
    assert len(batch) == 1 and batch[0].response_ids == [1, 2]
    assert not any(v for k, v in metrics.items() if "failed" in k), metrics


# ---------------------------------------------------------------- the one record of the version
def test_health_keeps_engines_serving_the_published_or_the_pending_version():
    """The client reads the publisher's record: an engine serving it (or the version a push in flight is
    loading) stays in; one serving another version is kept out until it serves the current one."""
    from sao_megatron.rollout.client import RolloutClient
    from sao_megatron.weights.readmission import CurrentWeights

    reported = {"a": "2", "b": "1"}

    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/model_info":
            return httpx.Response(200, json={"weight_version": reported[request.url.host]})
        return httpx.Response(200, json={})

    async def run():
        served = CurrentWeights(None, 1)
        client = RolloutClient(["http://a", "http://b"], served=served)
        client._http = httpx.AsyncClient(transport=httpx.MockTransport(engine))
        served.pending = 2  # a push of version 2 in flight: engine a took it already
        await client.health()
        during = sorted(client.healthy_urls())
        served.set(None, 2)
        served.pending = None  # committed: b still serves 1
        await client.health()
        after = sorted(client.healthy_urls())
        reported["b"] = "2"
        await client.health()
        return during, after, sorted(client.healthy_urls())
    during, after, caught_up = asyncio.run(run())
    assert during == ["http://a", "http://b"] and after == ["http://a"]
    assert caught_up == ["http://a", "http://b"]
