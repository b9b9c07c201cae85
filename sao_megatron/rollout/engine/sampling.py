"""Token sampling and the log-prob the engine reports, with SGLang 0.5.23's semantics.

SGLang's sampler (``srt/layers/sampler.py``), which the embedded engine copies:
- temperature below 1e-6 means greedy: top_k = 1 and temperature = 1;
- probs = softmax(logits / T); top-k then top-p zero out the tail of the sorted
  probs (a token survives top-p when the mass *before* it is <= top_p) and the
  token is drawn from what is left (``multinomial`` renormalises);
- the reported log-prob is ``log softmax(logits / T)[token]``: temperature
  applied, top-k/top-p truncation NOT renormalised. With the env var
  ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` SGLang reports ``log softmax(logits)``
  (no temperature) instead.

``logprob_mode`` selects: ``"sglang"`` (default, as above, so CPU and GPU runs
report the same quantity), ``"original"`` (SGLANG_RETURN_ORIGINAL_LOGPROB) or
``"sampled"``: the log-prob under the renormalised truncated distribution the
token was actually drawn from. With top_p = 1 and top_k = -1 (the RL default)
"sglang" and "sampled" are identical: the processed distribution is the one
sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LogprobMode = Literal["sglang", "original", "sampled"]
SAMPLING_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class RowParams:
    """Sampling settings of one request after SGLang's normalisation."""

    temperature: float
    top_p: float
    top_k: int  # -1: all

    @classmethod
    def normalised(cls, temperature: float, top_p: float, top_k: int) -> RowParams:
        if temperature < SAMPLING_EPS:  # SGLang: greedy is top_k=1 at temperature 1
            return cls(temperature=1.0, top_p=top_p, top_k=1)
        return cls(temperature=temperature, top_p=top_p, top_k=top_k)


def truncated_probs(probs_v: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """[V] probs with the top-k/top-p tail set to 0 (not renormalised), SGLang's torch path."""
    sorted_p, idx = probs_v.sort(descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        mass_before = torch.cumsum(sorted_p, 0) - sorted_p
        keep &= mass_before <= top_p
    keep[0] = True  # the most likely token always survives
    out = torch.zeros_like(probs_v)
    out[idx[keep]] = sorted_p[keep]
    return out


def sample_row(logits_v: torch.Tensor, params: RowParams, generator: torch.Generator,
               mode: LogprobMode = "sglang") -> tuple[int, float]:
    """Draw one token from [V] fp32 logits; returns (token id, its reported log-prob)."""
    logp_v = torch.log_softmax(logits_v.float() / params.temperature, dim=-1)
    if params.top_k == 1:
        token = int(torch.argmax(logits_v))
        kept = None
    else:
        kept = truncated_probs(logp_v.exp(), params.top_k, params.top_p)
        token = int(torch.multinomial(kept, 1, generator=generator))
    if mode == "original":
        return token, float(torch.log_softmax(logits_v.float(), dim=-1)[token])
    if mode == "sampled":  # greedy draws from a point mass: log 1 = 0
        return token, 0.0 if kept is None else float(torch.log(kept[token] / kept.sum()))
    return token, float(logp_v[token])


def reference_logprob(logits_v: torch.Tensor, token: int, params: RowParams, mode: LogprobMode = "sglang") -> float:
    """The log-prob ``sample_row`` reports for ``token``, recomputed from logits (parity checks)."""
    if mode == "original":
        return float(torch.log_softmax(logits_v.float(), dim=-1)[token])
    logp_v = torch.log_softmax(logits_v.float() / params.temperature, dim=-1)
    if mode == "sampled":
        if params.top_k == 1:
            return 0.0
        kept = truncated_probs(logp_v.exp(), params.top_k, params.top_p)
        return float(torch.log(kept[token] / kept.sum()))
    return float(logp_v[token])
