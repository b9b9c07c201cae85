"""SGLang's native ``/generate`` wire format (sglang 0.5.23): build requests, parse replies.

Pure functions, unit-tested against SGLang's own generated types
(``sglang/api/v1/api_types.py``). Replies are checked strictly because a
silently wrong log-prob or version poisons training: one log-prob entry per
output token with matching ids, and ``weight_versions`` spans that tile the
output exactly.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from sao_megatron.rollout.types import EngineReplyError, GenerateResult, SamplingParams

MAX_BODY_IN_ERROR = 500


def truncate(text: str, limit: int = MAX_BODY_IN_ERROR) -> str:
    """The first ``limit`` characters of an error body, marked when cut."""
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]"


def build_generate_payload(input_ids: list[int], sampling: SamplingParams, *, rid: str,
                           return_routed_experts: bool = False) -> dict[str, Any]:
    """A token-in ``/generate`` request asking for the log-prob of every output token."""
    if not input_ids:
        raise ValueError("input_ids is empty: a prompt needs at least one token")
    payload: dict[str, Any] = {
        "rid": rid,
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": sampling.to_sglang(),
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    if return_routed_experts:
        payload["return_routed_experts"] = True
    return payload


def versions_from_spans(spans: Any, num_tokens: int) -> list[int]:
    """Per-token versions from ``meta_info.weight_versions``, read as SGLang 0.5.23 builds them.

    ``spans`` is ``[{"version": "17", "start": 0, "end": 40}, ...]``: non-empty spans that tile
    ``[0, num_tokens)`` exactly. SGLang (``srt/utils/weight_versions.py``) records version changes
    only for requests that already have output, so its one zero-length span is the lone span
    ``[0, 0)`` of a reply with no output tokens (aborted or stopped before the first token);
    an empty list is accepted for such a reply too. Anything else raises ValueError.
    """
    if not isinstance(spans, list):
        raise ValueError(f"weight_versions must be a list of spans, got {type(spans).__name__}")
    if num_tokens == 0 and len(spans) <= 1:
        for span in spans:
            if _span_bounds(span) != (0, 0):
                raise ValueError(f"weight_versions span {span!r} for a reply with no output tokens; "
                                 "SGLang sends the lone span [0, 0) then")
            _int_version(span["version"])
        return []
    versions: list[int] = []
    for span in spans:
        start, end = _span_bounds(span)
        if start != len(versions) or end <= start:
            raise ValueError(f"weight_versions spans do not tile the output with non-empty spans: span {span!r} "
                             f"after {len(versions)} tokens")
        versions.extend([_int_version(span["version"])] * (end - start))
    if len(versions) != num_tokens:
        raise ValueError(f"weight_versions cover {len(versions)} tokens but there are {num_tokens} output tokens")
    return versions


def _span_bounds(span: Any) -> tuple[int, int]:
    if not isinstance(span, dict) or not {"version", "start", "end"} <= span.keys():
        raise ValueError(f"malformed weight_versions span {span!r}: needs version, start and end")
    start, end = span["start"], span["end"]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end)):
        raise ValueError(f"malformed weight_versions span {span!r}: start and end must be integers")
    return start, end


def _int_version(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"weight version {value!r} is not an integer; start engines with "
                         f"--weight-version 0 and push integer versions") from None


def decode_routed_experts(data: Any, num_rows: int, layout: tuple[int, int] | None) -> np.ndarray:
    """base64 int32 → [num_rows, num_layers, topk] (or [num_rows, -1] without a layout)."""
    if not isinstance(data, str):
        raise ValueError(f"routed_experts must be a base64 string, got {type(data).__name__}")
    try:
        flat = np.frombuffer(base64.b64decode(data, validate=True), dtype=np.int32)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"routed_experts is not base64 int32: {exc}") from None
    if num_rows == 0 and flat.size == 0:
        return flat.reshape(0, *(layout or (0,))).copy()
    if num_rows <= 0 or flat.size % num_rows:
        raise ValueError(f"routed_experts has {flat.size} ids, not a multiple of {num_rows} rows")
    if layout is None:
        return flat.reshape(num_rows, -1).copy()
    if flat.size != num_rows * layout[0] * layout[1]:
        raise ValueError(f"routed_experts has {flat.size} ids, expected {num_rows}x{layout[0]}x{layout[1]}")
    return flat.reshape(num_rows, *layout).copy()


def _finish_type(meta: dict[str, Any]) -> str:
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind not in ("stop", "length", "abort"):
        raise ValueError(f"finish_reason {finish!r} is not stop/length/abort")
    return kind


def _logprobs(meta: dict[str, Any], output_ids: list[int]) -> list[float]:
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list):
        raise ValueError("meta_info.output_token_logprobs is missing (was return_logprob sent?)")
    if len(entries) != len(output_ids):
        raise ValueError(f"{len(entries)} output_token_logprobs for {len(output_ids)} output_ids")
    out: list[float] = []
    for i, (entry, tok) in enumerate(zip(entries, output_ids)):
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], (int, float))
                and not isinstance(entry[0], bool)):
            raise ValueError(f"output_token_logprobs[{i}] = {entry!r} is not [logprob, token_id, text]")
        if entry[1] != tok:
            raise ValueError(f"output_token_logprobs[{i}] is for token {entry[1]} but output_ids[{i}] = {tok}")
        out.append(float(entry[0]))
    return out


def parse_generate_reply(reply: Any, *, rid: str, engine_url: str, latency_s: float,
                         routed_experts_layout: tuple[int, int] | None = None,
                         want_routed_experts: bool = False, prompt_len: int | None = None) -> GenerateResult:
    """Check a ``/generate`` reply and turn it into a ``GenerateResult``.

    ``prompt_len``: the number of ``input_ids`` sent, the prompt length of a request aborted while
    queued (see ``_queued_abort``). Raises ``EngineReplyError`` (with the reason) on anything malformed.
    """
    try:
        if _queued_abort(reply):
            reply = _as_queued_abort(reply, prompt_len, want_routed_experts)
        return _parse(reply, rid, engine_url, latency_s, routed_experts_layout, want_routed_experts)
    except (ValueError, TypeError, KeyError) as exc:
        raise EngineReplyError(f"malformed /generate reply from {engine_url} for rid {rid}: {exc}; "
                               f"body: {truncate(repr(reply))}", url=engine_url) from None


def _queued_abort(reply: Any) -> bool:
    """SGLang's reply to a request aborted in its waiting queue: finish type abort, no ``prompt_tokens``.

    The scheduler pops the request from ``waiting_queue`` and sends only an ``AbortReq``
    (``srt/managers/scheduler.py:abort_request`` → ``send_abort_output(_make_abort_req(req))``); the
    tokenizer manager answers it from its own request state (``tokenizer_manager.py:_handle_abort_req``):
    ``meta_info`` holds id, finish_reason, weight_version, e2e_latency, weight_versions, the log-probs
    it has (``add_logprob_to_meta_info``) and completion_tokens, but no ``prompt_tokens``,
    ``cached_tokens`` or ``routed_experts``. ``output_ids`` are the tokens it streamed before (none for
    a request that never ran; a retracted one keeps its earlier tokens).
    """
    meta = reply.get("meta_info") if isinstance(reply, dict) else None
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    return isinstance(finish, dict) and finish.get("type") == "abort" and "prompt_tokens" not in meta


def _as_queued_abort(reply: dict[str, Any], prompt_len: int | None, want_routed: bool) -> dict[str, Any]:
    """The queued-abort reply completed: the prompt length is the caller's. Its routes are unknown, so
    with routed experts asked for, its tokens are dropped (the resubmitted request generates them again
    and returns their routes); without, they are kept like any abort's partial output."""
    if prompt_len is None:
        raise ValueError("meta_info.prompt_tokens is missing")
    meta = dict(reply["meta_info"], prompt_tokens=prompt_len)
    if want_routed and "routed_experts" not in meta:
        spans = meta.get("weight_versions")
        version = spans[0]["version"] if isinstance(spans, list) and spans else meta.get("weight_version")
        meta |= {"routed_experts": "", "output_token_logprobs": [], "completion_tokens": 0,
                 "weight_versions": [{"version": version, "start": 0, "end": 0}]}
        return dict(reply, output_ids=[], meta_info=meta)
    return dict(reply, meta_info=meta)


def _parse(reply: Any, rid: str, engine_url: str, latency_s: float,
           layout: tuple[int, int] | None, want_routed: bool) -> GenerateResult:
    if not isinstance(reply, dict) or not isinstance(reply.get("meta_info"), dict):
        raise ValueError("reply is not an object with meta_info")
    meta = reply["meta_info"]
    output_ids = reply.get("output_ids")
    if not isinstance(output_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in output_ids):
        raise ValueError("output_ids is not a list of token ids")
    if meta.get("id", rid) != rid:
        raise ValueError(f"reply is for rid {meta.get('id')!r}")
    prompt_tokens = meta.get("prompt_tokens")
    if not isinstance(prompt_tokens, int):
        raise ValueError("meta_info.prompt_tokens is missing")
    routed = None
    if want_routed:
        if "routed_experts" not in meta:
            raise ValueError("routed_experts was requested but is missing (server started without "
                             "--enable-return-routed-experts?)")
        # SGLang: one row per token fed through the model, prompt + completion - 1 (none without output).
        rows = prompt_tokens + len(output_ids) - 1 if output_ids else 0
        routed = decode_routed_experts(meta["routed_experts"], rows, layout)
    return GenerateResult(
        rid=rid, output_ids=output_ids, logprobs=_logprobs(meta, output_ids),
        versions=versions_from_spans(meta.get("weight_versions", []), len(output_ids)),
        finish_reason=_finish_type(meta),  # type: ignore[arg-type]
        prompt_tokens=prompt_tokens, weight_version=_int_version(meta.get("weight_version")),
        routed_experts=routed, engine_url=engine_url, latency_s=latency_s)
