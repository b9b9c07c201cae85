"""The embedded engine's sampler vs slow references (SGLang 0.5.23 semantics)."""

from __future__ import annotations

import math

import pytest
import torch

from sao_megatron.rollout.engine.requests import BadRequest, parse_sampling
from sao_megatron.rollout.engine.sampling import RowParams, reference_logprob, sample_row, truncated_probs

pytestmark = pytest.mark.unit


def _truncated_reference(probs: list[float], top_k: int, top_p: float) -> list[float]:
    """Sort, keep the first top_k, keep while the mass before a token is <= top_p (first always kept)."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    out = [0.0] * len(probs)
    mass = 0.0
    for rank, i in enumerate(order):
        if rank > 0 and ((top_k > 0 and rank >= top_k) or mass > top_p):
            continue
        out[i] = probs[i]
        mass += probs[i]
    return out


@pytest.mark.parametrize("top_k,top_p", [(-1, 1.0), (3, 1.0), (-1, 0.5), (4, 0.7), (1, 1.0), (-1, 0.01)])
def test_truncation_matches_reference(top_k, top_p):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        probs = torch.softmax(torch.randn(16, generator=gen, dtype=torch.float64) * 2, -1)
        got = truncated_probs(probs, top_k, top_p).tolist()
        assert got == pytest.approx(_truncated_reference(probs.tolist(), top_k, top_p), abs=1e-12)


def test_samples_follow_the_truncated_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])
    params = RowParams.normalised(0.8, 0.9, 4)
    expected = truncated_probs(torch.softmax(logits / 0.8, -1), 4, 0.9)
    expected = expected / expected.sum()
    gen = torch.Generator().manual_seed(1)
    n = 3000
    counts = torch.zeros(6)
    for _ in range(n):
        token, _ = sample_row(logits, params, gen)
        counts[token] += 1
    assert counts[expected == 0].sum() == 0  # never outside the kept set
    chi2 = float((((counts - n * expected) ** 2) / (n * expected).clamp(min=1e-9))[expected > 0].sum())
    assert chi2 < 20.0  # <= 3 degrees of freedom: a correct sampler exceeds 20 with p < 2e-4 (fixed seed)


def test_reported_logprob_modes():
    logits = torch.tensor([1.0, 3.0, 0.0, -2.0])
    gen = torch.Generator().manual_seed(0)
    params = RowParams.normalised(0.5, 0.95, -1)
    token, lp = sample_row(logits, params, gen, "sglang")
    assert lp == pytest.approx(float(torch.log_softmax(logits / 0.5, -1)[token]))
    assert reference_logprob(logits, token, params, "sglang") == pytest.approx(lp)
    _, lp_orig = sample_row(logits, params, torch.Generator().manual_seed(0), "original")
    assert lp_orig == pytest.approx(float(torch.log_softmax(logits, -1)[token]))
    _, lp_sampled = sample_row(logits, params, torch.Generator().manual_seed(0), "sampled")
    kept = truncated_probs(torch.softmax(logits / 0.5, -1), -1, 0.95)
    assert lp_sampled == pytest.approx(math.log(kept[token] / kept.sum()))
    assert lp_sampled > lp  # renormalising over the kept set raises the log-prob


def test_greedy_is_argmax_at_temperature_one():
    logits = torch.tensor([0.1, 2.0, 1.9])
    params = RowParams.normalised(0.0, 1.0, -1)
    assert params == RowParams(temperature=1.0, top_p=1.0, top_k=1)
    token, lp = sample_row(logits, params, torch.Generator())
    assert token == 1 and lp == pytest.approx(float(torch.log_softmax(logits, -1)[1]))


def test_parse_sampling_follows_sglang():
    s = parse_sampling({"max_new_tokens": 5, "temperature": 0, "top_k": 1 << 30, "stop_token_ids": [3]}, 10)
    assert s.params.top_k == 1 and s.max_new_tokens == 5 and s.stop_token_ids == [3]
    assert parse_sampling({"top_k": 1 << 30}, 10).params.top_k == -1
    assert parse_sampling(None, 10).max_new_tokens == 128  # SGLang's default budget
    for bad in ({"max_tokens": 1}, {"min_p": 0.2}, {"repetition_penalty": 1.1}, {"n": 2}, {"top_k": 0},
                {"top_p": 0.0}, {"temperature": -1}, {"stop_token_ids": [10]}, {"regex": "a+"}):
        with pytest.raises(BadRequest):
            parse_sampling(bad, 10)
