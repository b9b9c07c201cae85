"""Turn a ``/generate`` JSON body (SGLang 0.5.23) into an engine request, or refuse it with a reason.

Anything SGLang would accept but this engine cannot honour exactly (penalties,
grammars, min_p, streaming, input log-probs) is refused with a 400
naming it: a request must never be silently sampled from another distribution
than the one asked for.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sao_megatron.rollout.engine.core import Request, request_generator
from sao_megatron.rollout.engine.sampling import RowParams

# sampling_params keys of sglang 0.5.23 (api/v1 SamplingParams) with the only values honoured here
# (None: any value). Unknown keys are a 400, as in SGLang.
SAMPLING_KEYS: dict[str, tuple | None] = {
    "max_new_tokens": None, "temperature": None, "top_p": None, "top_k": None, "stop_token_ids": None,
    "ignore_eos": None, "sampling_seed": None, "no_stop_trim": None, "skip_special_tokens": None,
    "spaces_between_special_tokens": None, "stream_interval": None,
    "stop": (None, "", []), "stop_regex": (None, "", []), "min_p": (0, 0.0), "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0), "min_new_tokens": (0,), "n": (1,),
    "json_schema": (None,), "regex": (None,), "ebnf": (None,), "structural_tag": (None,), "logit_bias": (None, {}),
    "custom_params": (None,), "beam_width": (None,), "watermark": (None,), "choice": (None, []),
}
TOP_K_ALL = 1 << 30  # SGLang's "all tokens" top_k


class BadRequest(ValueError):
    """A request this engine refuses (HTTP 400)."""


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against."""

    vocab_size: int
    max_context: int
    eos_ids: frozenset[int]
    routed_experts_enabled: bool


@dataclass(frozen=True)
class Sampling:
    params: RowParams
    max_new_tokens: int
    stop_token_ids: list[int]
    ignore_eos: bool
    seed: int | None


def _number(raw: dict, key: str, default: float) -> float:
    value = raw.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise BadRequest(f"sampling_params.{key} must be a number, got {value!r}")
    return float(value)


def parse_sampling(raw: Any, vocab_size: int) -> Sampling:
    """``sampling_params`` → normalised sampling settings (SGLang's defaults and checks)."""
    raw = raw or {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be an object (a list of objects for a batch)")
    for key, value in raw.items():
        if key not in SAMPLING_KEYS:
            raise BadRequest(f"unknown sampling_params field `{key}`")
        allowed = SAMPLING_KEYS[key]
        if allowed is not None and value not in allowed:
            raise BadRequest(f"sampling_params.{key}={value!r} is not supported by the embedded engine")
    max_new, top_k = raw.get("max_new_tokens", 128), raw.get("top_k", -1)
    temperature, top_p = _number(raw, "temperature", 1.0), _number(raw, "top_p", 1.0)
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0:
        raise BadRequest(f"max_new_tokens must be a non-negative integer, got {max_new!r}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise BadRequest(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    if isinstance(top_k, int) and top_k >= TOP_K_ALL:
        top_k = -1
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k == 0 or top_k < -1:
        raise BadRequest(f"top_k must be -1 or >= 1, got {top_k!r}")
    stop_ids = raw.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and 0 <= t < vocab_size for t in stop_ids):
        raise BadRequest(f"stop_token_ids must be token ids below the vocabulary size {vocab_size}")
    seed = raw.get("sampling_seed")
    if seed is not None and not isinstance(seed, int):
        raise BadRequest(f"sampling_seed must be an integer, got {seed!r}")
    return Sampling(RowParams.normalised(temperature, top_p, top_k), max_new, stop_ids,
                    bool(raw.get("ignore_eos", False)), seed)


def _check_prompt(ids: Any, limits: ModelLimits) -> list[int]:
    if ids is None:
        raise BadRequest("input_ids is required (the embedded engine is token-in/token-out)")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise BadRequest("input_ids must be a non-empty list of token ids (or a batch: a list of such lists)")
    if not all(0 <= t < limits.vocab_size for t in ids):
        raise BadRequest(f"input_ids contain ids outside the vocabulary [0, {limits.vocab_size})")
    if len(ids) >= limits.max_context:
        raise BadRequest(f"prompt of {len(ids)} tokens does not fit the context length {limits.max_context}")
    return list(ids)


def make_request(body: dict[str, Any], limits: ModelLimits, *, seed: int,
                 done: Callable[[dict[str, Any]], None]) -> Request:
    """A checked engine request from a ``/generate`` body; ``done`` receives the reply."""
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the embedded engine")
    prompt = _check_prompt(body.get("input_ids"), limits)
    if body.get("logprob_start_len") not in (None, -1) or (body.get("top_logprobs_num") or 0) > 0:
        raise BadRequest("only output-token log-probs are supported (logprob_start_len=-1, top_logprobs_num=0)")
    if body.get("routed_experts_start_len") not in (None, 0):
        raise BadRequest("routed_experts_start_len must be 0")
    want_routing = bool(body.get("return_routed_experts"))
    if want_routing and not limits.routed_experts_enabled:
        raise BadRequest("routed experts were not enabled: start with --enable-return-routed-experts")
    sampling = parse_sampling(body.get("sampling_params"), limits.vocab_size)
    rid = body.get("rid") or uuid.uuid4().hex
    if not isinstance(rid, str):
        raise BadRequest("rid must be a string (a list of strings for a batch)")
    stops = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(limits.eos_ids))
    return Request(rid=rid, prompt=prompt, params=sampling.params, max_new_tokens=sampling.max_new_tokens,
                   stop_ids=stops, return_logprob=bool(body.get("return_logprob")), want_routing=want_routing,
                   generator=request_generator(seed, rid, sampling.seed), done=done)
