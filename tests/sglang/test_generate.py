"""Batched /generate against a real SGLang server: log-probs, weight_versions spans, our parser."""

from __future__ import annotations

import httpx
import pytest
from conftest import VOCAB

from sao_megatron.rollout.protocol import build_generate_payload, parse_generate_reply
from sao_megatron.rollout.types import SamplingParams

pytestmark = pytest.mark.sglang

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20]]


def _post(server, path, payload, timeout=120.0):
    r = httpx.post(server.url + path, json=payload, headers=server.headers, timeout=timeout, trust_env=False)
    return r


def test_batched_generate_logprobs_and_spans(sglang_server):
    """A batch of token prompts: one reply per rid, in order; every output token has its log-prob
    (for that very token) and the spans tile the output at version 0; our parser accepts each."""
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    payloads = [build_generate_payload(p, sampling, rid=f"batch-{i}") for i, p in enumerate(PROMPTS)]
    batch = {k: [p[k] for p in payloads] for k in ("rid", "input_ids")}
    batch.update(sampling_params=payloads[0]["sampling_params"], return_logprob=True, logprob_start_len=-1)
    r = _post(sglang_server, "/generate", batch)
    assert r.status_code == 200, r.text
    replies = r.json()
    assert isinstance(replies, list) and len(replies) == len(PROMPTS)
    for i, (prompt, reply) in enumerate(zip(PROMPTS, replies)):
        meta = reply["meta_info"]
        assert meta["id"] == f"batch-{i}"
        assert meta["prompt_tokens"] == len(prompt)
        assert len(reply["output_ids"]) == 12 and all(0 <= t < VOCAB for t in reply["output_ids"])
        assert [e[1] for e in meta["output_token_logprobs"]] == reply["output_ids"]
        assert all(e[0] <= 0.0 for e in meta["output_token_logprobs"])
        assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 12}]
        assert meta["finish_reason"] == {"type": "length", "length": 12}
        result = parse_generate_reply(reply, rid=f"batch-{i}", engine_url=sglang_server.url, latency_s=0.0)
        assert result.versions == [0] * 12 and result.weight_version == 0
        assert result.logprobs == [e[0] for e in meta["output_token_logprobs"]]


def test_greedy_logprobs_match_a_second_request(sglang_server):
    """Greedy decoding is reproducible: the same prompt gives the same tokens and log-probs (a
    reference for the differential test: the engine's numbers are stable, not noise)."""
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    out = []
    for k in range(2):
        r = _post(sglang_server, "/generate", build_generate_payload(PROMPTS[1], sampling, rid=f"greedy-{k}"))
        assert r.status_code == 200, r.text
        out.append(parse_generate_reply(r.json(), rid=f"greedy-{k}", engine_url="", latency_s=0.0))
    assert out[0].output_ids == out[1].output_ids
    assert out[0].logprobs == pytest.approx(out[1].logprobs, abs=1e-5)
