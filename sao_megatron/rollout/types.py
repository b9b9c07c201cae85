"""Value types and errors shared by the rollout client, the scheduler and the trainer.

Everything here is plain data: no HTTP, no torch. The wire format (SGLang's
native ``/generate`` JSON) lives in ``protocol.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "retract", "in_place"]


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """Per-request sampling settings, a subset of SGLang's ``sampling_params``."""

    max_new_tokens: int
    """Generation budget of this request (tokens)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    top_k: int = -1
    """Top-k sampling; -1 disables it."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra stop tokens besides the model's EOS (the stop token is kept in the output)."""
    ignore_eos: bool = False
    """Do not stop at EOS (length-only stopping; tests and benchmarks)."""
    sampling_seed: int | None = None
    """Per-request sampling seed (SGLang honours it with deterministic inference enabled)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")

    def to_sglang(self) -> dict[str, Any]:
        """The ``sampling_params`` object of an SGLang ``/generate`` request.

        ``no_stop_trim`` keeps the stop token in the output and
        ``skip_special_tokens=False`` keeps special tokens: a trainer needs every
        sampled token with its log-prob.
        """
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.ignore_eos:
            out["ignore_eos"] = True
        if self.sampling_seed is not None:
            out["sampling_seed"] = self.sampling_seed
        return out


@dataclass(kw_only=True, slots=True)
class GenerateResult:
    """One finished (or aborted) generation, token-in/token-out."""

    rid: str
    """Request id (32 hex characters unless the caller chose one)."""
    output_ids: list[int]
    """Generated token ids, the stop token included."""
    logprobs: list[float]
    """Log-prob of each output token under the engine's sampling distribution (see engine/sampling.py)."""
    versions: list[int]
    """Policy (weight) version that produced each output token."""
    finish_reason: FinishReason
    """stop (EOS or a stop token), length (budget reached) or abort (aborted/paused; partial output)."""
    prompt_tokens: int
    """Prompt length as counted by the engine."""
    weight_version: int
    """Engine weight version when the reply was sent."""
    routed_experts: np.ndarray | None
    """int32 [prompt+completion-1, num_layers, topk] expert ids (or [N, num_layers*topk] when the
    client does not know the layout); None unless requested."""
    engine_url: str
    """URL the request was sent to (the router's URL when routed through sglang-router)."""
    latency_s: float
    """Wall-clock seconds from send to reply."""

    @property
    def num_tokens(self) -> int:
        return len(self.output_ids)


class EngineError(Exception):
    """Base class of every error raised by the rollout client."""


class EngineUnavailable(EngineError):
    """The engine could not be reached or died mid-request; it is marked unhealthy."""

    def __init__(self, message: str, *, url: str | None = None):
        super().__init__(message)
        self.url = url


class EngineReplyError(EngineError):
    """The engine answered, but with a non-2xx status or a malformed body (body truncated in the message)."""

    def __init__(self, message: str, *, url: str | None = None, status_code: int | None = None,
                 body: str | None = None):
        super().__init__(message)
        self.url = url
        self.status_code = status_code
        self.body = body


class EngineTimeout(EngineError):
    """No reply within the timeout; the request was aborted on the engine (best effort)."""

    def __init__(self, message: str, *, url: str | None = None):
        super().__init__(message)
        self.url = url
