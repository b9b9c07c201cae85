"""Metrics of sao_megatron.algorithms.metrics against numpy on the masked elements."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sao_megatron.algorithms.metrics import (
    advantage_stats, explained_variance, importance_ratio_metrics, masked_max, masked_mean, masked_min, masked_std,
    return_stats, value_metrics,
)

pytestmark = pytest.mark.unit


def _data(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 13, generator=gen, dtype=torch.float64)
    mask = torch.rand(5, 13, generator=gen) < 0.6
    return x, mask


def test_masked_statistics_match_numpy():
    x, mask = _data()
    x[~mask] = float("nan")  # values outside the mask must not matter
    picked = x[mask].numpy()
    assert masked_mean(x, mask).item() == pytest.approx(picked.mean())
    assert masked_std(x, mask).item() == pytest.approx(picked.std())
    assert masked_max(x, mask).item() == picked.max() and masked_min(x, mask).item() == picked.min()
    stats = advantage_stats(x, mask.float()) | return_stats(x, mask)
    assert stats["advantages/std"].item() == pytest.approx(picked.std())
    assert stats["returns/max"].item() == picked.max()


def test_empty_mask_gives_zeros():
    x, mask = torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.bool)
    for fn in (masked_mean, masked_std, masked_max, masked_min):
        assert fn(x, mask).item() == 0.0
    metrics = importance_ratio_metrics(torch.randn(2, 3), mask)
    assert all(v.item() == 0.0 for v in metrics.values())
    assert masked_max(torch.zeros(0, 3), torch.zeros(0, 3)).item() == 0.0


def test_importance_ratio_metrics_match_formulas():
    log_ratio, mask = _data(1)
    log_ratio = log_ratio * 0.5
    lr = log_ratio[mask].numpy()
    r = np.exp(lr)
    m = importance_ratio_metrics(log_ratio, mask, prefix="p")
    assert m["p/ratio_mean"].item() == pytest.approx(r.mean())
    assert m["p/ratio_max"].item() == pytest.approx(r.max()) and m["p/ratio_min"].item() == pytest.approx(r.min())
    assert m["p/kl_k1"].item() == pytest.approx(np.mean(-lr))
    assert m["p/kl_k3"].item() == pytest.approx(np.mean(r - 1 - lr))
    assert m["p/ess"].item() == pytest.approx(r.sum() ** 2 / (len(r) * (r * r).sum()))
    assert m["p/num_action_tokens"].item() == len(r)


def test_ess_is_one_on_policy_and_small_when_one_token_dominates():
    mask = torch.ones(1, 100, dtype=torch.bool)
    assert importance_ratio_metrics(torch.full((1, 100), 0.3), mask)["actor/ess"].item() == pytest.approx(1.0)
    skewed = torch.zeros(1, 100)
    skewed[0, 0] = 50.0  # a +50 log-prob gap: finite, and the ESS collapses to one token in 100
    m = importance_ratio_metrics(skewed, mask)
    assert all(math.isfinite(v.item()) for v in m.values())
    assert m["actor/ess"].item() == pytest.approx(0.01, rel=1e-6)
    assert m["actor/kl_k3"].item() >= 0


def test_explained_variance():
    returns, mask = _data(2)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    mean = returns[mask].mean()
    assert explained_variance(torch.full_like(returns, mean.item()), returns, mask).item() == pytest.approx(0.0, abs=1e-12)
    values = returns + 0.5 * torch.randn_like(returns)
    g, v = returns[mask].numpy(), values[mask].numpy()
    assert explained_variance(values, returns, mask).item() == pytest.approx(1 - np.var(g - v) / np.var(g))
    assert math.isnan(explained_variance(values, torch.ones_like(returns), mask).item())
    vm = value_metrics(values, returns, mask)
    assert vm["critic/value_abs_error"].item() == pytest.approx(np.abs(v - g).mean())
    assert vm["critic/values_mean"].item() == pytest.approx(v.mean())
