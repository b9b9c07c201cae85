"""Client ⇄ embedded engines over real loopback HTTP, directly and behind the real sglang-router.

Every exchange is validated against SGLang 0.5.23's own types (api_types.py for
/generate and info replies, io_struct.py for control payloads), and every
log-prob against a fresh HF forward of the weights that produced the token.
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from rollout_fixtures import (  # noqa: F401 - fixtures
    API_KEY,
    LAYERS,
    LOGPROB_TOL,
    TOPK,
    ContractRecorder,
    assert_close,
    hf_reference,
    hf_routed_experts,
    poll_until,
)

from sao_megatron.rollout import EngineReplyError, EngineUnavailable, RolloutClient, SamplingParams
from sao_megatron.rollout.launch import SGLangRouterProcess

pytestmark = pytest.mark.component


def client_for(urls, recorder=None, **kw) -> RolloutClient:
    return RolloutClient(urls, api_key=API_KEY, timeout_s=60, on_exchange=recorder,
                         routed_experts_layout=(LAYERS, TOPK), **kw)


def server_state(url: str) -> dict:
    r = httpx.get(url + "/server_info", headers={"Authorization": f"Bearer {API_KEY}"}, trust_env=False)
    return r.json()["internal_states"][0]


def wait_tokens(url: str, rid: str, at_least: int) -> None:
    poll_until(lambda: server_state(url)["num_output_tokens"].get(rid, 0) >= at_least, what=f"{rid} tokens")


async def _restore(client: RolloutClient, base_dir, version: int) -> None:
    await client.update_weights_from_disk(str(base_dir), weight_version=version)


def test_concurrent_generate_logprobs_and_routing(engines, tiny_dirs):  # noqa: F811
    recorder = ContractRecorder()
    prompts = [[5, 6, 7], [9], [10, 11, 12, 13, 14, 15], [20, 21], [30, 31, 32, 33], [40, 41, 42], [50], [60, 61]]
    samplings = [SamplingParams(max_new_tokens=8 + i % 3, temperature=[1.0, 0.7, 1.2, 0.0][i % 4],
                                top_k=[-1, 8][i % 2], top_p=[1.0, 0.9][i // 4]) for i in range(len(prompts))]

    async def run():
        async with client_for(engines.urls, recorder) as client:
            return await asyncio.gather(*(client.generate(p, s, return_routed_experts=(i % 2 == 0))
                                          for i, (p, s) in enumerate(zip(prompts, samplings))))
    results = asyncio.run(run())
    assert not recorder.errors and recorder.counts["/generate"] == len(prompts)
    assert {r.engine_url for r in results} == set(engines.urls)  # least-loaded spread over both engines
    assert max(server_state(u)["max_decode_batch"] for u in engines.urls) >= 2  # batched decode happened
    for i, (p, s, r) in enumerate(zip(prompts, samplings, results)):
        assert len(r.rid) == 32 and r.versions == [0] * len(r.output_ids) and r.prompt_tokens == len(p)
        assert_close(r.logprobs, hf_reference(tiny_dirs["base"], p, r.output_ids, s))
        if i % 2 == 0:  # routed experts of every token fed through the model: prompt + output[:-1]
            expected = hf_routed_experts(tiny_dirs["base"], p + r.output_ids[:-1]).numpy()
            np.testing.assert_array_equal(np.sort(r.routed_experts, -1), np.sort(expected, -1))
        else:
            assert r.routed_experts is None


def test_through_real_sglang_router(engines, tiny_dirs, tmp_path):  # noqa: F811
    recorder = ContractRecorder()
    with SGLangRouterProcess(engines.urls, api_key=API_KEY, log_dir=tmp_path) as router:
        async def run():
            async with client_for(engines.urls, recorder, router_url=router.url) as client:
                res = await asyncio.gather(*(client.generate([3, 4, 5 + i], SamplingParams(max_new_tokens=6))
                                             for i in range(6)))
                info = await client.model_info()  # control/info calls go to the engines directly
                return res, info
        results, info = asyncio.run(run())
    assert not recorder.errors and recorder.counts["/generate"] == 6
    assert {r.engine_url for r in results} == {router.url}
    assert sorted(i["url"] for i in info) == sorted(engines.urls)
    for i, r in enumerate(results):
        assert_close(r.logprobs, hf_reference(tiny_dirs["base"], [3, 4, 5 + i], r.output_ids,
                                              SamplingParams(max_new_tokens=6)))


def test_pause_retract_update_continue(engines, tiny_dirs):  # noqa: F811
    recorder = ContractRecorder()
    sp = SamplingParams(max_new_tokens=120, ignore_eos=True)
    prompt = [11, 12, 13]

    async def run():
        async with client_for(engines.urls, recorder) as client:
            task = asyncio.create_task(client.generate(prompt, sp, rid="a" * 32))
            await asyncio.sleep(0)
            url = await asyncio.to_thread(poll_until, lambda: client.engine_of("a" * 32), 10)
            await asyncio.to_thread(wait_tokens, url, "a" * 32, 3)
            await client.pause_generation("retract")
            await client.begin_weight_update()
            await client.update_weights_from_disk(str(tiny_dirs["other"]), weight_version=1)
            await client.end_weight_update()
            versions = {i["weight_version"] for i in await client.model_info()}
            await client.continue_generation()
            result = await task
            await _restore(client, tiny_dirs["base"], 2)
            return result, versions
    r, versions = asyncio.run(run())
    assert not recorder.errors and versions == {"1"}
    assert r.finish_reason == "length" and len(r.output_ids) == 120 and r.weight_version == 1
    switch = r.versions.index(1)
    assert 3 <= switch < 120 and r.versions == [0] * switch + [1] * (120 - switch)  # two spans
    assert_close(r.logprobs[:switch], hf_reference(tiny_dirs["base"], prompt, r.output_ids[:switch], sp))
    new_ref = hf_reference(tiny_dirs["other"], prompt, r.output_ids, sp)
    assert_close(r.logprobs[switch:], new_ref[switch:])


def test_pause_abort_then_resubmit(engines, tiny_dirs):  # noqa: F811
    sp = SamplingParams(max_new_tokens=100, ignore_eos=True)
    prompt = [21, 22, 23, 24]

    async def run():
        async with client_for(engines.urls, ContractRecorder()) as client:
            rid = "c" * 32
            task = asyncio.create_task(client.generate(prompt, sp, rid=rid))
            url = await asyncio.to_thread(poll_until, lambda: client.engine_of(rid), 10)
            await asyncio.to_thread(wait_tokens, url, rid, 1)
            await client.pause_generation("abort")
            partial = await task
            held = asyncio.create_task(client.generate([1, 2], SamplingParams(max_new_tokens=2)))
            await asyncio.sleep(0.3)
            held_while_paused = not held.done()
            await client.continue_generation()
            rest = SamplingParams(max_new_tokens=100 - len(partial.output_ids), ignore_eos=True)
            cont = await client.generate(prompt + partial.output_ids, rest, rid=partial.rid)
            await held
            return partial, cont, held_while_paused
    partial, cont, held_while_paused = asyncio.run(run())
    assert partial.finish_reason == "abort" and 1 <= len(partial.output_ids) < 100
    assert held_while_paused
    assert cont.finish_reason == "length" and cont.engine_url == partial.engine_url  # sticky rid
    full = partial.output_ids + cont.output_ids
    assert_close(partial.logprobs + cont.logprobs, hf_reference(tiny_dirs["base"], prompt, full, sp))


def test_abort_request_returns_partial(engines):  # noqa: F811
    async def run():
        async with client_for(engines.urls, ContractRecorder()) as client:
            rid = "b" * 32
            task = asyncio.create_task(client.generate([7, 7, 7], SamplingParams(max_new_tokens=200, ignore_eos=True),
                                                       rid=rid))
            url = await asyncio.to_thread(poll_until, lambda: client.engine_of(rid), 10)
            await asyncio.to_thread(wait_tokens, url, rid, 2)
            await client.abort_request(rid)
            return await task
    r = asyncio.run(run())
    assert r.finish_reason == "abort" and 2 <= len(r.output_ids) < 200
    assert len(r.logprobs) == len(r.versions) == len(r.output_ids)


def test_client_gone_aborts_on_engine(engines):  # noqa: F811
    """A client that stops waiting (timeout, cancelled task) frees the engine, as in SGLang."""
    url = engines.urls[1]
    before = server_state(url)["aborted"]
    with httpx.Client(trust_env=False) as http, pytest.raises(httpx.TimeoutException):
        http.post(url + "/generate", timeout=0.1, headers={"Authorization": f"Bearer {API_KEY}"},
                  json={"rid": "e" * 32, "input_ids": [4, 5], "sampling_params": {"max_new_tokens": 250,
                                                                                   "ignore_eos": True}})
    poll_until(lambda: "e" * 32 not in server_state(url)["num_output_tokens"], what="request gone")
    assert server_state(url)["aborted"] == before + 1

def test_bad_weight_dirs_rejected_and_old_weights_kept(engines, tiny_dirs):  # noqa: F811
    async def run():
        async with client_for(engines.urls, ContractRecorder()) as client:
            errors = []
            for bad in ("bad_config", "bad_names"):
                with pytest.raises(EngineReplyError) as info:
                    await client.update_weights_from_disk(str(tiny_dirs[bad]), weight_version=99)
                errors.append(info.value)
            versions = {i["weight_version"] for i in await client.model_info()}
            result = await client.generate([5, 6, 7], SamplingParams(max_new_tokens=5))
            return errors, versions, result
    errors, versions, r = asyncio.run(run())
    assert all(e.status_code == 400 for e in errors)
    assert "rope" in str(errors[0]) and "lm_head" in str(errors[1])
    assert "99" not in versions
    assert_close(r.logprobs, hf_reference(tiny_dirs["base"], [5, 6, 7], r.output_ids, SamplingParams(max_new_tokens=5)))


def test_api_key_and_small_endpoints(engines):  # noqa: F811
    url = engines.urls[0]
    with httpx.Client(trust_env=False, timeout=30) as http:
        assert http.post(url + "/generate", json={"input_ids": [1]}).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        for path in ("/model_info", "/server_info", "/flush_cache"):
            assert http.get(url + path, headers=wrong).status_code == 401
        assert http.post(url + "/pause_generation", json={"mode": "abort"}, headers=wrong).status_code == 401
        assert http.get(url + "/health").status_code == 200  # health probes are exempt, as in SGLang
        assert http.get(url + "/health_generate").status_code == 200
        good = {"Authorization": f"Bearer {API_KEY}"}
        bad = http.post(url + "/generate", headers=good, json={"input_ids": [1], "sampling_params": {"max_tokens": 3}})
        assert bad.status_code == 400 and "max_tokens" in bad.text
        bad = http.post(url + "/generate", headers=good, json={"input_ids": [1], "sampling_params": {"min_p": 0.1}})
        assert bad.status_code == 400 and "min_p" in bad.text
        assert http.post(url + "/flush_cache", headers=good).status_code == 200
        nccl = http.post(url + "/init_weights_update_group", headers=good, json={})
        assert nccl.status_code == 400

    async def wrong_key():
        async with RolloutClient(engines.urls, api_key="wrong") as client:
            with pytest.raises(EngineReplyError) as info:
                await client.generate([1, 2], SamplingParams(max_new_tokens=2))
            assert info.value.status_code == 401 and "Unauthorized" in str(info.value)
            return client.healthy_urls()
    assert len(asyncio.run(wrong_key())) == 2  # a refused request is not an unhealthy engine


def test_hf_parity_gate(engines, tiny_dirs):  # noqa: F811
    """The documented first parity gate: engine log-probs vs HF transformers, fp32 CPU."""
    from sao_megatron.rollout.parity import hf_parity

    prompts = [[3, 4, 5], [6], [7, 8, 9, 10, 11], [12, 13]]
    report = hf_parity(tiny_dirs["base"], prompts, SamplingParams(max_new_tokens=16, temperature=0.9),
                       engine_urls=engines.urls, api_key=API_KEY)
    assert report["parity/num_tokens"] >= 4 and report["parity/max_abs"] < LOGPROB_TOL, report

def test_disk_weight_sync_push(engines, tiny_dirs, tmp_path):  # noqa: F811
    from safetensors.torch import load_file

    from sao_megatron.weights.disk import DiskWeightSync

    recorder = ContractRecorder()
    sp = SamplingParams(max_new_tokens=6)

    async def run():
        async with client_for(engines.urls, recorder) as client:
            loop = asyncio.get_running_loop()
            sync = DiskWeightSync(client=client, sync_root=tmp_path, template_dir=tiny_dirs["base"], keep_last=1,
                                  max_shard_bytes=50_000, collective=False, api_key=API_KEY)
            await asyncio.to_thread(sync.connect, client.engine_urls, is_sender=True)  # how each engine holds weights

            def paused(update):  # the sync runs off the loop; its engine calls run on the client's loop
                asyncio.run_coroutine_threadsafe(update(), loop).result()
            tensors = load_file(tiny_dirs["other"] / "model.safetensors")
            metrics = await asyncio.to_thread(sync.push, tensors.items(), 5, paused=paused)
            versions = {i["weight_version"] for i in await client.model_info()}
            result = await client.generate([8, 9, 10], sp)
            base = load_file(tiny_dirs["base"] / "model.safetensors")
            await asyncio.to_thread(sync.push, base.items(), 6, paused=paused)
            sync.close()
            return metrics, versions, result
    metrics, versions, r = asyncio.run(run())
    assert not recorder.errors and recorder.counts["/update_weights_from_disk"] == 4  # 2 pushes x 2 engines
    assert versions == {"5"} and r.versions == [5] * len(r.output_ids)
    assert metrics["weight_sync/bytes"] > 0 and [p.name for p in tmp_path.iterdir()] == ["v000006"]
    assert metrics["weight_sync/verified"] == 1  # the first push of the layout compared checksums
    assert_close(r.logprobs, hf_reference(tiny_dirs["other"], [8, 9, 10], r.output_ids, sp))

def test_engine_killed_mid_request(engines):  # noqa: F811 - kills an engine (the next test gets it back)
    async def run():
        async with client_for(engines.urls) as client:
            rid = "d" * 32
            task = asyncio.create_task(client.generate([9, 9, 9], SamplingParams(max_new_tokens=250, ignore_eos=True),
                                                       rid=rid))
            url = await asyncio.to_thread(poll_until, lambda: client.engine_of(rid), 10)
            await asyncio.to_thread(wait_tokens, url, rid, 2)
            engines.kill(engines.urls.index(url))
            with pytest.raises(EngineUnavailable):
                await asyncio.wait_for(task, 30)
            healthy = client.healthy_urls()
            after = await client.generate([1, 2], SamplingParams(max_new_tokens=3))
            health = await client.health()
            return url, healthy, after, health
    dead, healthy, after, health = asyncio.run(run())
    assert dead not in healthy and len(healthy) == 1
    assert after.engine_url == healthy[0] and health == {u: u != dead for u in engines.urls}
