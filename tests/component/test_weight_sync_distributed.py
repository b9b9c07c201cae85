"""``rollout.weight_sync.transport=distributed`` against real embedded engines: SGLang's update-group protocol over
gloo, checksums from /weights_checker, session rules, and an engine killed during a sync.

The sender is one process without a trainer world (one owner of every tensor); the multi-rank
trainer path is in tests/e2e/test_weight_sync_trainer.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time

import httpx
import pytest
import torch
from rollout_fixtures import API_KEY, assert_close, hf_reference

from sao_megatron.rollout import contract
from sao_megatron.rollout.client import RolloutClient
from sao_megatron.rollout.types import SamplingParams
from sao_megatron.rollout.weight_check import WeightMismatchError, held_name
from sao_megatron.weights.distributed import DistributedWeightSync, WeightSyncError

pytestmark = pytest.mark.component
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


_SYNC_IDS = itertools.count()


def other_tensors(tiny_dirs) -> list[tuple[str, torch.Tensor]]:  # noqa: F811
    from safetensors.torch import load_file

    return sorted(load_file(tiny_dirs["other"] / "model.safetensors").items())


def make_sync(**kw) -> tuple[DistributedWeightSync, list[tuple[str, dict]]]:
    """A sync whose every request body is checked against SGLang 0.5.23's io_struct (and recorded)."""
    # Own group names per sync: a group an earlier test abandoned on an engine cannot collide with ours.
    kw.setdefault("group_prefix", f"sao_wsync{next(_SYNC_IDS)}")
    sync = DistributedWeightSync(backend="gloo", api_key=API_KEY, master_address="127.0.0.1", timeout_s=20,
                                 **kw)
    calls: list[tuple[str, dict]] = []
    post = sync._post

    def checked(url, path, body):
        contract.check_control_request(path, body)
        calls.append((path, body))
        return post(url, path, body)
    sync._post = checked
    return sync, calls


def engine_logprobs(urls, prompt, sp):
    async def run():
        async with RolloutClient(urls, api_key=API_KEY) as client:
            return [await client._generate_at(u, {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": sp.max_new_tokens, "temperature": sp.temperature}, "return_logprob": True,
                "rid": f"r{i}"}, f"r{i}", False, via_router=False) for i, u in enumerate(urls)]
    return asyncio.run(run())


def push_other(engines, tiny_dirs, version: int) -> None:  # noqa: F811
    """Serve the "other" weights on every engine (tests that check what engines serve after a push)."""
    sync, _ = make_sync()
    sync.connect(engines.urls, is_sender=True)
    try:
        sync.push(other_tensors(tiny_dirs), version)
    finally:
        sync.close()


def versions(urls) -> list[str]:
    return [httpx.get(u + "/model_info", headers=HEADERS).json()["weight_version"] for u in urls]


def test_push_reaches_both_engines_and_verifies(engines, tiny_dirs):  # noqa: F811
    sync, calls = make_sync(bucket_bytes=40_000)
    sync.connect(engines.urls, is_sender=True)
    try:
        metrics = sync.push(other_tensors(tiny_dirs), 5)
    finally:
        sync.close()
    paths = [p for p, _ in calls]
    assert paths.count("/init_weights_update_group") == 2 and paths.count("/begin_weight_update") == 2
    assert paths.count("/end_weight_update") == 2
    updates = [b for p, b in calls if p == "/update_weights_from_distributed"]
    assert len(updates) >= 6 and all(b["load_format"] == "flattened_bucket" for b in updates)
    assert [b.get("weight_version") for b in updates].count("5") == 2  # the last bucket per engine only
    assert all(b["flush_cache"] == ("weight_version" in b) for b in updates)
    assert all(len({str(d) for d in b["dtypes"]}) == 1 for b in updates)  # one dtype per bucket: aligned
    assert metrics["weight_sync/verified"] == 1 and metrics["weight_sync/failed_engines"] == 0
    assert metrics["weight_sync/bytes"] == 2 * sum(t.numel() * 4 for _, t in other_tensors(tiny_dirs))
    assert metrics["weight_sync/engine_bytes"] == metrics["weight_sync/sender_bytes_max"] == metrics[
        "weight_sync/bytes"] / 2 and metrics["weight_sync/num_senders"] == 1
    assert versions(engines.urls) == ["5", "5"]
    sp = SamplingParams(max_new_tokens=6, temperature=0.8)
    for result in engine_logprobs(engines.urls, [8, 9, 10], sp):
        assert_close(result.logprobs, hf_reference(tiny_dirs["other"], [8, 9, 10], result.output_ids, sp))


def test_checksums_are_sglangs(engines, tiny_dirs):  # noqa: F811
    """Reference: sha256 of the raw bytes, first 8 bytes big-endian (SGLang's CPU tensor_hash)."""
    from safetensors.torch import load_file

    push_other(engines, tiny_dirs, 5)
    reply = httpx.post(engines.urls[0] + "/weights_checker", json={"action": "checksum"}, headers=HEADERS).json()
    contract.check_control_request("/weights_checker", {"action": "checksum"})
    assert reply["success"] and len(reply["ranks"]) == 1
    sums = reply["ranks"][0]["checksums"]
    served = load_file(tiny_dirs["other"] / "model.safetensors")  # what this test pushed

    def ref(*names):  # SGLang's fused parameters hold their checkpoint tensors' rows in this order
        return hashlib.sha256(b"".join(served[n].contiguous().numpy().tobytes() for n in names)).digest()[:8].hex()
    for name in served:
        if held_name(name) == name:
            assert sums[name] == ref(name), name
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp.experts."
    assert sums[a + "qkv_proj.weight"] == ref(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight")
    assert sums[m + "w13_weight"] == ref(*[f"{m}{e}.{p}_proj.weight" for e in range(4) for p in ("gate", "up")])
    assert sums[m + "w2_weight"] == ref(*[f"{m}{e}.down_proj.weight" for e in range(4)])
    assert set(sums) == {held_name(n) for n in served}
    overall = hashlib.sha256(b"".join(n.encode() + sums[n].encode() for n in sorted(sums))).hexdigest()
    assert reply["ranks"][0]["per_gpu_checksum"] == overall
    assert reply["per_engine_checksum"] == hashlib.sha256(overall.encode()).hexdigest()


def test_session_rules_are_sglangs(engines):
    url = engines.urls[0]

    def post(path, body=None):
        return httpx.post(url + path, json=body or {}, headers=HEADERS)
    body = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[128, 32]], "group_name": "nope"}
    r = post("/update_weights_from_distributed", body)
    assert r.status_code == 400 and "between begin_weight_update() and end_weight_update()" in r.json()["message"]
    assert post("/end_weight_update").status_code == 400
    assert post("/begin_weight_update").status_code == 200
    assert post("/begin_weight_update").status_code == 400
    r = post("/update_weights_from_distributed", body)  # in a session, but no such group
    assert r.status_code == 400 and "Please call `init_weights_update_group` first" in r.json()["message"]
    assert post("/end_weight_update").status_code == 200
    r = post("/destroy_weights_update_group", {"group_name": "nope"})
    assert r.status_code == 400 and r.json() == {"success": False,
                                                 "message": "The group to be destroyed does not exist."}


def test_corrupted_bytes_stop_with_the_tensor_name(engines, tiny_dirs, monkeypatch):  # noqa: F811
    import sao_megatron.weights.distributed as wsd

    real = wsd.DistributedWeightSync._flatten

    def corrupt(self, bucket, k, stats):  # flips one byte of lm_head in transit (a receive-buffer race, say)
        flat = real(self, bucket, k, stats)
        if any(t.shape == (128, 32) for _, t in bucket):
            flat.buf[7] ^= 0xFF
        return flat
    monkeypatch.setattr(wsd.DistributedWeightSync, "_flatten", corrupt)
    sync, _ = make_sync(bucket_bytes=40_000)
    sync.connect(engines.urls, is_sender=True)
    try:
        with pytest.raises(WeightMismatchError, match=r"lm_head\.weight|embed_tokens\.weight"):
            sync.push(other_tensors(tiny_dirs), 6)
        monkeypatch.setattr(wsd.DistributedWeightSync, "_flatten", real)
        sync.reconnect(engines.urls[1])  # rebuilt groups; the next push is verified again
        assert sync.needs_verify
        metrics = sync.push(other_tensors(tiny_dirs), 7)
    finally:
        sync.close()
    assert metrics["weight_sync/verified"] == 1 and versions(engines.urls) == ["7", "7"]


def test_refused_update_leaves_engine_out_until_reconnect(engines, tiny_dirs):  # noqa: F811
    """Engine 1 refuses mid-sync (its session was closed under it): the sync finishes on engine 0, the
    broken group is abandoned, and reconnect builds a new one so the next push reaches both."""
    before = versions(engines.urls)
    sync, _ = make_sync(bucket_bytes=20_000)
    sync.connect(engines.urls, is_sender=True)
    real, seen = sync._send_bucket, []

    def send(link, bucket, version):
        seen.append(link.index)
        if link.index == 1 and seen.count(1) == 2:
            httpx.post(link.url + "/end_weight_update", json={}, headers=HEADERS)
        return real(link, bucket, version)
    sync._send_bucket = send
    try:
        metrics = sync.push(other_tensors(tiny_dirs), 11)
        assert metrics["weight_sync/failed_engines"] == 1 and versions(engines.urls) == ["11", before[1]]
        sync._send_bucket = real
        sync.reconnect(engines.urls[1])
        metrics = sync.push(other_tensors(tiny_dirs), 12)
    finally:
        sync.close()
    assert metrics["weight_sync/failed_engines"] == 0 and metrics["weight_sync/verified"] == 1
    assert versions(engines.urls) == ["12", "12"]


def test_generate_batch_and_text_as_sglang(engines, tiny_dirs):  # noqa: F811
    """A batch (list of lists) answers a list in order, each reply as the single request's;
    text without a tokenizer is refused with SGLang's own message."""
    from sao_megatron.rollout.engine.batching import TEXT_REFUSED

    push_other(engines, tiny_dirs, 5)
    url = engines.urls[0]
    sp = {"max_new_tokens": 5, "temperature": 0.7, "sampling_seed": 3}
    prompts = [[8, 9, 10], [4], [20, 21, 22, 23]]
    body = {"input_ids": prompts, "sampling_params": sp, "return_logprob": True, "rid": ["b0", "b1", "b2"]}
    batch = httpx.post(url + "/generate", json=body, headers=HEADERS, timeout=60).json()
    contract.check_generate_request(body)
    assert isinstance(batch, list) and [r["meta_info"]["id"] for r in batch] == ["b0", "b1", "b2"]
    for prompt, reply in zip(prompts, batch):
        contract.check_generate_reply(reply)
        single = httpx.post(url + "/generate", headers=HEADERS, timeout=60, json={
            "input_ids": prompt, "sampling_params": sp, "return_logprob": True}).json()
        assert reply["output_ids"] == single["output_ids"]
        lps = [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]
        params = SamplingParams(max_new_tokens=5, temperature=0.7)
        assert_close(lps, hf_reference(tiny_dirs["other"], prompt, reply["output_ids"], params))
    r = httpx.post(url + "/generate", json={"text": "hello", "sampling_params": sp}, headers=HEADERS)
    assert r.status_code == 400 and r.json()["error"]["message"] == TEXT_REFUSED
    r = httpx.post(url + "/generate", json={"input_ids": [[1, 2], [1, 999]]}, headers=HEADERS)
    assert r.status_code == 400 and "vocabulary" in r.text  # one bad prompt refuses the whole batch


def fused_reference(pushed):
    """The test's own tensors grouped under SGLang's held names, parts in SGLang's row order: q, k, v;
    each expert's gate then up (w13); the experts' down (w2). Unfused tensors stand alone."""
    rank = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "gate_proj": 0, "up_proj": 1, "down_proj": 0}
    groups: dict[str, list] = {}
    for name, t in pushed:
        groups.setdefault(held_name(name), []).append((name, t))

    def key(item):
        parts = item[0].split(".")
        expert = int(parts[parts.index("experts") + 1]) if "experts" in parts else 0
        return expert, rank.get(parts[-2], 0)
    return {held: [t for _, t in sorted(items, key=key)] for held, items in groups.items()}


def test_pipelined_buckets_deliver_every_tensor_in_order(engines, tiny_dirs):  # noqa: F811
    """Many small buckets, each flattened while the one before is on the wire and loaded while the next
    arrives (reused buffers on both ends): both engines then hold exactly the pushed bytes (sha256 of the
    test's own tensors), bucket after bucket in the export's order, for two different pushes in a row."""
    from sao_megatron.rollout.loader_groups import plan_buckets

    named = other_tensors(tiny_dirs)
    sync, calls = make_sync(bucket_bytes=1 << 20, pipeline_bytes=6_000, verify=False)
    sync.connect(engines.urls, is_sender=True)
    try:
        for version, scale in ((21, 0.5), (22, 1.0)):
            pushed = [(n, t * scale) for n, t in named]
            calls.clear()
            sync.push(pushed, version)
            plan = plan_buckets([n for n, _ in pushed], [t.numel() * 4 for _, t in pushed],
                                [t.dtype for _, t in pushed], family=None, max_bucket_bytes=6_000)
            updates = [b for p, b in calls if p == "/update_weights_from_distributed"]
            for url in engines.urls:
                group = [b for b in updates if b["group_name"].endswith(f"_e{engines.urls.index(url)}_g1")]
                assert len(group) == len(plan) and len(plan) > 6  # no extra call: a lone sender's last
                assert [b["names"] for b in group] == [[pushed[i][0] for i in bucket] for bucket in plan]
                # bucket carries the version (and the cache flush), after every other bucket was sent
                assert [b.get("weight_version") for b in group] == [None] * (len(plan) - 1) + [str(version)]
                assert [b["flush_cache"] for b in group] == [False] * (len(plan) - 1) + [True]
                sums = httpx.post(url + "/weights_checker", json={"action": "checksum"},
                                  headers=HEADERS).json()["ranks"][0]["checksums"]
                for held, parts in fused_reference(pushed).items():
                    want = hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in parts)).digest()[:8]
                    assert sums[held] == want.hex(), held
            assert versions(engines.urls) == [str(version)] * 2
    finally:
        sync.close()


@pytest.mark.parametrize("fail_after", [0, 40])
def test_export_failing_mid_push_ends_the_sessions(engines, tiny_dirs, fail_after):  # noqa: F811
    """The export raises before its first bucket (the sessions may still be opening on the send thread)
    or after several buckets: the error reaches the caller, every session that opened is ended (SGLang
    refuses a second begin while one is open) and the engines keep their version; the next push lands."""
    named = other_tensors(tiny_dirs)
    sync, calls = make_sync(bucket_bytes=1 << 20, pipeline_bytes=6_000, verify=False)
    sync.connect(engines.urls, is_sender=True)
    before = versions(engines.urls)

    def failing():
        yield from named[:fail_after]
        raise RuntimeError("export broke")
    try:
        with pytest.raises(RuntimeError, match="export broke"):
            sync.push(failing(), 31)
        paths = [p for p, _ in calls]
        assert paths.count("/begin_weight_update") == paths.count("/end_weight_update") == 2
        assert (paths.count("/update_weights_from_distributed") > 0) == (fail_after > 0)
        assert all("weight_version" not in b for p, b in calls if p == "/update_weights_from_distributed")
        assert versions(engines.urls) == before
        sync.push(named, 32)
        assert versions(engines.urls) == ["32", "32"]
    finally:
        sync.close()


# Last in the file: it kills both engines, and each restart (a fresh process: 10-44 s) is paid by the
# next test that takes ``engines``; here none follows in file order (the reversed CI stage still pays it).
def test_engine_killed_during_sync(engines, tiny_dirs):  # noqa: F811 - kills the engines (revived for the next test)
    sync, _ = make_sync(bucket_bytes=20_000)
    sync.connect(engines.urls, is_sender=True)
    real, sent = sync._send_bucket, []

    def send(link, bucket, version):
        sent.append(link.index)
        if sent.count(1) == 2:  # engine 1 dies after its first bucket, in the middle of the sync
            engines.kill(1)
        return real(link, bucket, version)
    sync._send_bucket = send
    start = time.monotonic()
    try:
        metrics = sync.push(other_tensors(tiny_dirs), 8)
        assert time.monotonic() - start < 60
        assert metrics["weight_sync/failed_engines"] == 1 and list(sync.failed_engines()) == [engines.urls[1]]
        assert versions(engines.urls[:1]) == ["8"]
        metrics = sync.push(other_tensors(tiny_dirs), 9)  # the dead engine stays out until reconnect
        assert metrics["weight_sync/failed_engines"] == 1 and versions(engines.urls[:1]) == ["9"]
        engines.kill(0)
        with pytest.raises(WeightSyncError, match="reached no engine"):
            sync.push(other_tensors(tiny_dirs), 10)
    finally:
        sync.close()
    assert time.monotonic() - start < 120
