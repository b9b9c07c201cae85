"""``weight_versions`` spans read exactly as SGLang 0.5.23 builds them.

SGLang's own span builder (``srt/utils/weight_versions.py`` from the pinned wheel, extracted by
``scripts/sglang_contract.sh``) runs on generated request histories: tokens generated, weight
updates (with the scheduler's event recording) and retractions (with its event truncation). The
reference is the history itself: the version each token was generated under.
"""

from __future__ import annotations

import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sao_megatron.rollout import contract
from sao_megatron.rollout.protocol import parse_generate_reply, versions_from_spans
from sao_megatron.rollout.types import EngineReplyError

pytestmark = pytest.mark.unit

# One step of a request's life: ("gen", k tokens) | ("update", version increment) | ("retract", kept fraction).
_STEP = st.one_of(st.tuples(st.just("gen"), st.integers(1, 5)),
                  st.tuples(st.just("update"), st.integers(0, 2)),
                  st.tuples(st.just("retract"), st.floats(0.0, 1.0)))


def _simulate(steps: list[tuple], first_version: int) -> tuple[list, int, list[int]]:
    """Drive SGLang's event functions through ``steps``: (events, current version, true per-token versions)."""
    sgl = contract.weight_versions()
    req = types.SimpleNamespace(output_ids=[], weight_version_events=[])
    truth: list[int] = []
    version = first_version
    for kind, arg in steps:
        if kind == "gen":
            req.output_ids += [7] * arg
            truth += [version] * arg
        elif kind == "update":
            sgl.record_weight_version_events([req], old_version=str(version))
            version += arg
        else:
            kept = int(arg * len(req.output_ids))
            req.output_ids, truth = req.output_ids[:kept], truth[:kept]
            req.weight_version_events = sgl.truncate_weight_version_events(req.weight_version_events, kept)
    return req.weight_version_events, version, truth


def _sglang_meta(events: list, version: int, num_built: int, num_visible: int) -> dict:
    sgl = contract.weight_versions()
    meta: dict = {}
    spans = sgl.compute_weight_version_spans(events, str(version), num_built)
    sgl.add_weight_versions_to_meta_info(meta, spans, num_visible)
    return meta


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(_STEP, max_size=12), first_version=st.integers(0, 50))
def test_reader_maps_sglang_spans_to_the_true_versions(steps, first_version):
    events, version, truth = _simulate(steps, first_version)
    meta = _sglang_meta(events, version, len(truth), len(truth))
    assert versions_from_spans(meta["weight_versions"], len(truth)) == truth
    assert int(meta["weight_version"]) == (truth[-1] if truth else version)


@settings(max_examples=100, deadline=None)
@given(steps=st.lists(_STEP, max_size=12), first_version=st.integers(0, 50), cut=st.floats(0.0, 1.0))
def test_reader_maps_a_visible_prefix(steps, first_version, cut):
    """SGLang clips the spans to the tokens a reply shows (fewer than the scheduler built them for)."""
    events, version, truth = _simulate(steps, first_version)
    visible = int(cut * len(truth))
    meta = _sglang_meta(events, version, len(truth), visible)
    assert versions_from_spans(meta["weight_versions"], visible) == truth[:visible]


def test_reply_without_output_tokens_is_accepted():
    """An aborted request with no output: SGLang's lone [0, 0) span, encoded with its own reply types."""
    t = contract.api_types()
    meta = _sglang_meta([], 3, 0, 0)
    assert meta["weight_versions"] == [{"version": "3", "start": 0, "end": 0}]
    info = t.GenerateMetaInfo(id="r", prompt_tokens=4, completion_tokens=0,
                              finish_reason=t.decode_FinishReason({"type": "abort", "message": "aborted"}),
                              output_token_logprobs=[], weight_version=meta["weight_version"],
                              weight_versions=[t.WeightVersionSpan(**s) for s in meta["weight_versions"]])
    reply = t.GenerateResponse(text="", meta_info=info, output_ids=[]).to_json_value()
    res = parse_generate_reply(reply, rid="r", engine_url="http://e", latency_s=0.0)
    assert res.output_ids == [] and res.versions == [] and res.finish_reason == "abort" and res.weight_version == 3


def _span(start, end, version="1") -> dict:
    return {"version": version, "start": start, "end": end}


@pytest.mark.parametrize("spans,num_tokens,match", [
    ([_span(0, 0), _span(0, 2)], 2, "non-empty"),             # zero-length span before output
    ([_span(0, 2), _span(2, 2), _span(2, 3)], 3, "non-empty"),  # zero-length span inside
    ([_span(0, 2), _span(2, 2)], 2, "non-empty"),             # zero-length span at the end
    ([_span(0, 0), _span(0, 0)], 0, "non-empty"),             # two empty spans
    ([_span(1, 1)], 0, "no output tokens"),                   # empty span not at 0
    ([_span(0, 1)], 0, "no output tokens"),                   # tokens where there are none
    ([_span(0, 0)], 2, "non-empty"),                          # lone empty span but output exists
    ([_span(0, 2), _span(3, 4)], 4, "do not tile"),           # gap
    ([_span(0, 2), _span(1, 4)], 4, "do not tile"),           # overlap
    ([_span(0, 2)], 3, "cover 2 tokens"),                     # short
    ([], 2, "cover 0 tokens"),
    ([_span(0, "2")], 2, "integers"),
    ([_span(0, True)], 1, "integers"),
    ([{"version": "1", "start": 0}], 1, "needs version, start and end"),
    ([_span(0, 0, version="v7")], 0, "not an integer"),
    ({"version": "1", "start": 0, "end": 1}, 1, "must be a list"),
])
def test_malformed_spans_are_rejected_with_the_reason(spans, num_tokens, match):
    with pytest.raises(ValueError, match=match):
        versions_from_spans(spans, num_tokens)


def _reference_valid(spans: list[dict], num_tokens: int) -> bool:
    """Slow and obvious: SGLang's shapes are the lone [0, 0) (or nothing) without output, else a tiling."""
    if num_tokens == 0:
        return spans == [] or [(s["start"], s["end"]) for s in spans] == [(0, 0)]
    covered = [i for s in spans for i in range(s["start"], s["end"])]
    return all(s["end"] > s["start"] for s in spans) and covered == list(range(num_tokens))


@settings(max_examples=200, deadline=None)
@given(bounds=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=4), num_tokens=st.integers(0, 6))
def test_reader_accepts_exactly_the_valid_span_lists(bounds, num_tokens):
    spans = [_span(a, b, version=str(i)) for i, (a, b) in enumerate(bounds)]
    if _reference_valid(spans, num_tokens):
        expected = [int(s["version"]) for s in spans for _ in range(s["start"], s["end"])]
        assert versions_from_spans(spans, num_tokens) == expected
    else:
        with pytest.raises(ValueError, match="weight_versions"):
            versions_from_spans(spans, num_tokens)
