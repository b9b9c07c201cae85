"""The embedded engine against the real SGLang 0.5.23 server: the same requests, the same replies.

Every scenario runs against both engines, serving the same fp32 weights, and compares what a
trainer reads: which fields a reply has, finish reasons, weight_versions spans, the routed-experts
layout, abort replies (running, waiting-queue, held while paused, rid prefixes), the weight-update
session rules and the /weights_checker format. Greedy tokens and log-probs must agree too.
"""

from __future__ import annotations

import base64
import hashlib
import threading
import time

import httpx
import numpy as np
import pytest
from conftest import API_KEY, LAYERS, TOPK

from sao_megatron.rollout.launch import LocalEngines
from sao_megatron.rollout.weight_check import EngineHolding, expected_checksums

pytestmark = pytest.mark.sglang

# Fields of a /generate reply's meta_info that the trainer's side may read; each must be present in
# the embedded engine's reply exactly when it is present in SGLang's. (SGLang adds more that
# nothing here reads: reasoning_tokens, dp_rank, cached_tokens_details, response_sent_to_client_ts.)
COMPARED = ("id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
            "weight_versions", "output_token_logprobs", "routed_experts", "e2e_latency", "num_retractions")
LONG = 3000  # tokens: still running two seconds after it started, on either engine (~400 tok/s at best)


@pytest.fixture(scope="module")
def embedded(tiny_moe, tmp_path_factory):
    with LocalEngines(tiny_moe("fp32"), 1, api_key=API_KEY, log_dir=tmp_path_factory.mktemp("diff-embedded"),
                      extra_args=["--weight-version", "0", "--skip-tokenizer-init",
                                  "--enable-return-routed-experts"]) as engines:
        yield engines.urls[0]


@pytest.fixture
def both(sglang_server, embedded):
    return {"sglang": sglang_server.url, "embedded": embedded}


def _client() -> httpx.Client:
    return httpx.Client(trust_env=False, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"})


def _body(rid: str, n: int, *, prompt=(5, 6, 7), temperature=1.0, routed=True) -> dict:
    return {"rid": rid, "input_ids": list(prompt), "return_logprob": True, "logprob_start_len": -1,
            "return_routed_experts": routed,
            "sampling_params": {"max_new_tokens": n, "temperature": temperature, "ignore_eos": True,
                                "no_stop_trim": True, "skip_special_tokens": False}}


def _shape(reply: dict) -> dict:
    """What the comparison looks at: top-level keys, which compared fields are there, and values whose
    meaning must agree (finish reason, spans' versions and bounds relative to the output)."""
    meta = reply["meta_info"]
    n = len(reply["output_ids"])
    routed = None
    if "routed_experts" in meta:
        rows = np.frombuffer(base64.b64decode(meta["routed_experts"]), np.int32).size // (LAYERS * TOPK)
        routed = rows == (meta["prompt_tokens"] + n - 1 if n else 0)
    return {"keys": sorted(k for k in reply if k != "text") + (["text"] if "text" in reply else []),
            "fields": sorted(k for k in COMPARED if k in meta), "finish": meta["finish_reason"],
            "spans_tile_output": _tiles(meta["weight_versions"], n),
            "span_versions": sorted({s["version"] for s in meta["weight_versions"]}),
            "routed_rows_as_expected": routed,
            "logprob_ids_match": [e[1] for e in meta.get("output_token_logprobs", [])] == reply["output_ids"]}


def _tiles(spans: list[dict], n: int) -> bool:
    """Spans cover [0, n) in order without gaps; a reply without output has the one span [0, 0)."""
    if n == 0:
        return len(spans) == 1 and (spans[0]["start"], spans[0]["end"]) == (0, 0)
    bounds = [(s["start"], s["end"]) for s in spans]
    return bounds[0][0] == 0 and bounds[-1][1] == n and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))


def _generate_in_thread(http, url, body, out):
    t = threading.Thread(target=lambda: out.setdefault(body["rid"], http.post(url + "/generate", json=body)))
    t.start()
    return t


def _on_both(both, scenario):
    results = {}
    for name, url in both.items():
        with _client() as http:
            results[name] = scenario(http, url)
    return results


def test_generate_reply_structure(both):
    def scenario(http, url):
        r = http.post(url + "/generate", json=_body("diff-gen", 6))
        assert r.status_code == 200, r.text
        return _shape(r.json())
    res = _on_both(both, scenario)
    assert res["embedded"] == res["sglang"]
    assert res["sglang"]["finish"] == {"type": "length", "length": 6}
    assert res["sglang"]["routed_rows_as_expected"] is True


def test_greedy_tokens_and_logprobs_agree(both):
    """Same fp32 weights, greedy: the same tokens, log-probs within float32 kernel noise."""
    def scenario(http, url):
        r = http.post(url + "/generate", json=_body("diff-greedy", 16, prompt=(9, 10, 11, 12), temperature=0.0,
                                                    routed=True))
        meta = r.json()["meta_info"]
        experts = np.frombuffer(base64.b64decode(meta["routed_experts"]), np.int32).reshape(-1, LAYERS, TOPK)
        return r.json()["output_ids"], [e[0] for e in meta["output_token_logprobs"]], np.sort(experts, axis=-1)
    res = _on_both(both, scenario)
    assert res["embedded"][0] == res["sglang"][0]
    np.testing.assert_allclose(res["embedded"][1], res["sglang"][1], atol=2e-3)
    np.testing.assert_array_equal(res["embedded"][2], res["sglang"][2])  # top-k sets; order may differ


def test_abort_running_request(both):
    def scenario(http, url):
        out = {}
        t = _generate_in_thread(http, url, _body("diff-run", LONG), out)
        time.sleep(2.0)
        assert http.post(url + "/abort_request", json={"rid": "diff-run"}).status_code == 200
        t.join(60)
        assert out["diff-run"].status_code == 200
        shape = _shape(out["diff-run"].json())
        assert 0 < out["diff-run"].json()["meta_info"]["completion_tokens"] < LONG
        return shape
    res = _on_both(both, scenario)
    assert res["embedded"] == res["sglang"]
    assert res["sglang"]["finish"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def test_abort_in_waiting_queue(both):
    """Retracted by a pause, then aborted: SGLang drops it from its waiting queue with a short reply:
    no prompt_tokens, no routed_experts, and of its output only the blocks of 50 tokens it had
    already forwarded to its tokenizer manager (the rest is lost)."""
    def scenario(http, url):
        out = {}
        t = _generate_in_thread(http, url, _body("diff-wait", LONG), out)
        time.sleep(2.0)
        try:
            assert http.post(url + "/pause_generation", json={"mode": "retract"}).status_code == 200
            assert http.post(url + "/abort_request", json={"rid": "diff-wait"}).status_code == 200
            t.join(60)
        finally:
            http.post(url + "/continue_generation", json={})
        reply = out["diff-wait"]
        assert reply.status_code == 200
        return reply.json()
    res = _on_both(both, scenario)
    shapes = {k: _shape(v) for k, v in res.items()}
    assert shapes["embedded"] == shapes["sglang"]
    for reply in res.values():
        meta = reply["meta_info"]
        assert len(reply["output_ids"]) == meta["completion_tokens"] and meta["completion_tokens"] % 50 == 0
    real = res["sglang"]
    assert real["text"] == "" and "prompt_tokens" not in real["meta_info"]
    assert "routed_experts" not in real["meta_info"] and "cached_tokens" not in real["meta_info"]
    assert real["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}


def test_abort_does_not_reach_a_request_held_while_paused(both):
    """A request sent during a pause waits outside the scheduler: an abort misses it, and it runs
    to the end after continue."""
    def scenario(http, url):
        out = {}
        assert http.post(url + "/pause_generation", json={"mode": "retract"}).status_code == 200
        try:
            t = _generate_in_thread(http, url, _body("diff-held", 5), out)
            time.sleep(1.0)
            assert http.post(url + "/abort_request", json={"rid": "diff-held"}).status_code == 200
            time.sleep(0.5)
            finished_while_paused = "diff-held" in out
        finally:
            http.post(url + "/continue_generation", json={})
        t.join(60)
        return finished_while_paused, _shape(out["diff-held"].json())
    res = _on_both(both, scenario)
    assert res["embedded"] == res["sglang"]
    assert res["sglang"][0] is False and res["sglang"][1]["finish"] == {"type": "length", "length": 5}


def test_abort_matches_rid_prefixes(both):
    """An abort's rid matches every request whose rid starts with it; an empty rid matches none.

    other-1 must still be open once the prefixed requests have answered (it used to be checked by
    comparing token counts after a 0.5 s sleep, which a loaded machine could fill with no decode step)."""
    def scenario(http, url):
        out = {}
        rids = ("diffpre-1", "diffpre-12", "other-1")
        threads = dict(zip(rids, (_generate_in_thread(http, url, _body(rid, LONG), out) for rid in rids)))
        time.sleep(2.0)
        assert http.post(url + "/abort_request", json={"rid": ""}).status_code == 200  # matches nothing
        assert http.post(url + "/abort_request", json={"rid": "diffpre-1"}).status_code == 200
        threads["diffpre-1"].join(60)
        threads["diffpre-12"].join(60)
        threads["other-1"].join(1.0)  # had an abort reached it, its reply would be here by now
        other_open = "other-1" not in out
        http.post(url + "/abort_request", json={"rid": "other-1"})
        threads["other-1"].join(60)
        return {rid: r.json()["meta_info"]["finish_reason"]["type"] for rid, r in out.items()}, other_open
    res = _on_both(both, scenario)
    assert res["embedded"] == res["sglang"] == ({"diffpre-1": "abort", "diffpre-12": "abort", "other-1": "abort"}, True)


def test_weight_update_session_rules(both, sglang_server):
    model_dir = str(sglang_server.model_dir)

    def scenario(http, url):
        seen = []

        def call(path, body):
            r = http.post(url + path, json=body)  # successes and refusals alike must say the same
            seen.append((path, r.status_code, r.json().get("success"), r.json().get("message")))

        call("/end_weight_update", {})
        call("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]],
                                                  "group_name": "g"})
        call("/update_weights_from_disk", {"model_path": model_dir, "weight_version": "5"})
        version_after_disk = http.get(url + "/model_info").json()["weight_version"]
        call("/begin_weight_update", {})
        call("/begin_weight_update", {})
        call("/update_weights_from_disk", {"model_path": model_dir, "weight_version": "6"})
        call("/end_weight_update", {})
        version_after_session = http.get(url + "/model_info").json()["weight_version"]
        http.post(url + "/update_weights_from_disk", json={"model_path": model_dir, "weight_version": "0"})
        return seen, version_after_disk, version_after_session
    res = _on_both(both, scenario)
    assert res["embedded"] == res["sglang"]
    statuses = [(path, code) for path, code, _, _ in res["sglang"][0]]
    assert statuses == [("/end_weight_update", 400), ("/update_weights_from_distributed", 400),
                        ("/update_weights_from_disk", 200), ("/begin_weight_update", 200),
                        ("/begin_weight_update", 400), ("/update_weights_from_disk", 200),
                        ("/end_weight_update", 200)]
    assert res["sglang"][1:] == ("5", "6")
    assert res["sglang"][0][2][3] == "Succeeded to update model weights. Weight version updated to 5."


def test_weights_checker_format(both):
    """Same reply structure; per-tensor checksums are 16 hex digits; per_engine_checksum is the
    sha256 of the one rank's per_gpu_checksum, which is the sha256 over sorted name + checksum."""
    def scenario(http, url):
        r = http.post(url + "/weights_checker", json={"action": "checksum"})
        assert r.status_code == 200, r.text
        body = r.json()
        rank = body["ranks"][0]
        overall = hashlib.sha256()
        for name in sorted(rank["checksums"]):
            overall.update(name.encode())
            overall.update(rank["checksums"][name].encode())
        assert rank["per_gpu_checksum"] == overall.hexdigest()
        assert body["per_engine_checksum"] == hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()
        assert all(len(c) == 16 and int(c, 16) >= 0 for c in rank["checksums"].values())
        bad = http.post(url + "/weights_checker", json={"action": "nope"})
        return (sorted(body), sorted(rank), rank["parallelism_info"], bad.status_code,
                bad.json())
    res = _on_both(both, scenario)
    assert res["embedded"] == res["sglang"]


def test_weights_checker_names_and_checksums(both, sglang_server):
    """Both report SGLang's parameter names (qkv_proj, experts.w13_weight/w2_weight: fused), and each
    checksum is what the trainer's verification expects from that engine for the weights it serves:
    the checkpoint's tensors fused, cast and padded as that engine holds them (weight_check)."""
    from safetensors.torch import load_file

    served = [(n, t) for f in sorted(sglang_server.model_dir.glob("*.safetensors")) for n, t in load_file(f).items()]

    def scenario(http, url):
        sums = http.post(url + "/weights_checker", json={"action": "checksum"}).json()["ranks"][0]["checksums"]
        holding = EngineHolding.from_server_info(http.get(url + "/server_info").json(), checkpoint_dtype="float32")
        return sums, expected_checksums(served, holding)
    res = _on_both(both, scenario)
    assert sorted(res["embedded"][0]) == sorted(res["sglang"][0])
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.experts.w13_weight",
            "model.layers.0.mlp.experts.w2_weight"} <= set(res["sglang"][0])
    for name, (sums, expected) in res.items():
        assert sums == expected, (name, sorted(k for k in sums if sums[k] != expected.get(k)))
    # the same bytes on both but for the vocabulary rows SGLang pads to a multiple of 64 (VOCAB is not one)
    differ = sorted(k for k in res["sglang"][0] if res["sglang"][0][k] != res["embedded"][0][k])
    assert differ == ["lm_head.weight", "model.embed_tokens.weight"]
