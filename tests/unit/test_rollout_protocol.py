"""Wire format of /generate against SGLang 0.5.23's own generated types, and the built-in router."""

from __future__ import annotations

import base64
import random

import numpy as np
import pytest

from sao_megatron.rollout import contract
from sao_megatron.rollout.protocol import (
    build_generate_payload,
    decode_routed_experts,
    parse_generate_reply,
    versions_from_spans,
)
from sao_megatron.rollout.routing import LeastLoadedRouter
from sao_megatron.rollout.types import EngineReplyError, EngineUnavailable, SamplingParams

pytestmark = pytest.mark.unit


def _spans_reference(versions: list[int]) -> list[dict]:
    """Run-length encode per-token versions the obvious way."""
    spans: list[dict] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == str(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": str(v), "start": i, "end": i + 1})
    return spans


def _sglang_reply(rid: str, out: list[int], lps: list[float], versions: list[int], finish: dict,
                  prompt_tokens: int = 3) -> dict:
    """A reply built with SGLang's own encoder (so field names/types are SGLang's, not ours)."""
    t = contract.api_types()
    meta = t.GenerateMetaInfo(
        id=rid, prompt_tokens=prompt_tokens, completion_tokens=len(out), finish_reason=t.decode_FinishReason(finish),
        output_token_logprobs=[t.LogprobEntry(logprob=lp, token_id=tok, text=None) for lp, tok in zip(lps, out)],
        weight_version=str(versions[-1] if versions else 0),
        weight_versions=[t.WeightVersionSpan(**s) for s in _spans_reference(versions)])
    return t.GenerateResponse(text="", meta_info=meta, output_ids=out).to_json_value()


def test_request_payload_is_valid_sglang():
    sp = SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=5, stop_token_ids=[2, 3], ignore_eos=True,
                        sampling_seed=11)
    payload = build_generate_payload([5, 6, 7], sp, rid="ab" * 16, return_routed_experts=True)
    contract.check_generate_request(payload)
    decoded = contract.api_types().decode_GenerateRequest(payload)
    assert decoded.input_ids == [5, 6, 7] and decoded.rid == "ab" * 16
    assert decoded.sampling_params.top_k == 5 and decoded.sampling_params.stop_token_ids == [2, 3]
    assert decoded.sampling_params.no_stop_trim is True and decoded.return_logprob is True


def test_contract_rejects_unknown_sampling_key():
    with pytest.raises(contract.ContractError, match="max_tokens"):
        contract.check_generate_request({"input_ids": [1], "sampling_params": {"max_tokens": 3}})


@pytest.mark.parametrize("bad", [dict(max_new_tokens=-1), dict(max_new_tokens=1, temperature=-0.1),
                                 dict(max_new_tokens=1, top_p=0.0), dict(max_new_tokens=1, top_k=0)])
def test_sampling_params_validation(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_versions_from_spans_matches_reference():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randrange(0, 30)
        versions = sorted(rng.randrange(0, 4) for _ in range(n))
        assert versions_from_spans(_spans_reference(versions), n) == versions


@pytest.mark.parametrize("spans,n", [
    ([{"version": "1", "start": 0, "end": 3}], 4),                                     # short
    ([{"version": "1", "start": 0, "end": 2}, {"version": "2", "start": 3, "end": 4}], 4),  # gap
    ([{"version": "1", "start": 0, "end": 3}, {"version": "2", "start": 2, "end": 4}], 4),  # overlap
    ([{"version": "x", "start": 0, "end": 4}], 4),                                     # not an int
    ([{"version": "1", "start": 1, "end": 4}], 4),                                     # not from 0
    ([], 2),
])
def test_versions_from_spans_rejects_bad_tiling(spans, n):
    with pytest.raises(ValueError):
        versions_from_spans(spans, n)


def test_parse_reply_roundtrip():
    out, lps, vers = [4, 9, 1], [-0.5, -1.25, -0.01], [3, 3, 4]
    reply = _sglang_reply("r1", out, lps, vers, {"type": "stop", "matched": 1})
    contract.check_generate_reply(reply)
    res = parse_generate_reply(reply, rid="r1", engine_url="http://e", latency_s=0.1)
    assert (res.output_ids, res.logprobs, res.versions, res.finish_reason) == (out, lps, vers, "stop")
    assert res.weight_version == 4 and res.prompt_tokens == 3 and res.routed_experts is None


@pytest.mark.parametrize("mutate,match", [
    (lambda r: r["meta_info"]["output_token_logprobs"].pop(), "output_token_logprobs for"),
    (lambda r: r["meta_info"]["output_token_logprobs"][1].__setitem__(1, 77), "is for token 77"),
    (lambda r: r["meta_info"]["weight_versions"].pop(), "weight_versions"),
    (lambda r: r["meta_info"].__setitem__("finish_reason", {"type": "weird"}), "finish_reason"),
    (lambda r: r["meta_info"].__setitem__("id", "other"), "rid"),
    (lambda r: r.__setitem__("output_ids", "nope"), "output_ids"),
    (lambda r: r.pop("meta_info"), "meta_info"),
])
def test_parse_reply_rejects_malformed(mutate, match):
    reply = _sglang_reply("r1", [4, 9, 1], [-0.5, -1.0, -2.0], [3, 3, 4], {"type": "length", "length": 3})
    mutate(reply)
    with pytest.raises(EngineReplyError, match=match):
        parse_generate_reply(reply, rid="r1", engine_url="http://e", latency_s=0.0)


def test_routed_experts_decode():
    ids = np.arange(5 * 2 * 3, dtype=np.int32).reshape(5, 2, 3)
    data = base64.b64encode(ids.tobytes()).decode()
    np.testing.assert_array_equal(decode_routed_experts(data, 5, (2, 3)), ids)
    np.testing.assert_array_equal(decode_routed_experts(data, 5, None), ids.reshape(5, 6))
    with pytest.raises(ValueError):
        decode_routed_experts(data, 4, (2, 3))


def test_router_least_loaded_and_sticky():
    r = LeastLoadedRouter(["a", "b", "c"])
    picks = []
    for i in range(6):
        u = r.pick(f"rid{i}")
        r.acquire(f"rid{i}", u)
        picks.append(u)
    assert sorted(picks) == ["a", "a", "b", "b", "c", "c"]  # each new request goes to a least-loaded engine
    assert r.pick("rid0") == picks[0]  # sticky
    r.release(picks[0])
    r.mark_unhealthy(picks[0])
    assert r.pick("rid0") != picks[0]  # sticky engine gone → another one
    for u in r.urls:
        r.mark_unhealthy(u)
    with pytest.raises(EngineUnavailable):
        r.pick("x")


def test_control_schema_comes_from_io_struct():
    schema = contract.io_struct_schema("UpdateWeightsFromDistributedReqInput")
    assert {"names", "dtypes", "shapes", "weight_version"} <= set(schema)
    assert schema["names"].required and not schema["weight_version"].required
    contract.check_control_request("/update_weights_from_distributed",
                                   {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[2, 3]], "weight_version": "1"})
    with pytest.raises(contract.ContractError):
        contract.check_control_request("/update_weights_from_distributed", {"names": ["a"]})
    with pytest.raises(contract.ContractError):
        contract.check_control_request("/pause_generation", {"mode": "retract", "bogus": 1})
