"""DIS, PPO-clip and value losses and the aggregation modes against per-token reference loops,
including exact gradients and extreme log-prob gaps."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import algo_reference as ref
from sao_megatron.algorithms.losses import aggregate_loss, dis_policy_loss, ppo_clip_policy_loss, value_loss

pytestmark = pytest.mark.unit
PROPS = settings(max_examples=60, deadline=None, derandomize=True)
TOL = dict(rtol=1e-10, atol=1e-12)


def _batch(seed: int, batch: int = 4, length: int = 30, gap: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    mask = ref.multi_turn_mask(random.Random(seed), batch, length)
    rollout = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    logp = (rollout + gap * torch.randn(batch, length, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return logp, rollout, adv, mask


def _per_token_reference(fn, *tensors, mask):
    """Apply a per-token reference over action tokens: (losses [B, T], grads [B, T]) as float64."""
    losses, grads = torch.zeros(mask.shape, dtype=torch.float64), torch.zeros(mask.shape, dtype=torch.float64)
    for b, t in mask.nonzero().tolist():
        out = fn(*(float(x[b, t]) for x in tensors))
        losses[b, t], grads[b, t] = out[0], out[1]
    return losses, grads


# ------------------------------------------------------------------------------------------- DIS

@pytest.mark.parametrize("eps_low,eps_high", [(0.3, 5.0), (0.8, 3.0), (0.2, 0.2), (1.0, 0.0)])
def test_dis_loss_and_gradient_match_reference(eps_low, eps_high):
    logp, rollout, adv, mask = _batch(seed=1, gap=1.5)
    num_tokens = 1000  # the global count: larger than this micro-batch's
    loss, metrics = dis_policy_loss(logp, rollout, adv, mask, eps_low=eps_low, eps_high=eps_high, num_tokens=num_tokens)
    loss.backward()
    fn = lambda lp, rl, a: ref.dis_token(lp, rl, a, eps_low, eps_high)  # noqa: E731
    losses, grads = _per_token_reference(fn, logp.detach(), rollout, adv, mask=mask)
    torch.testing.assert_close(loss.detach(), losses.sum() / num_tokens, **TOL)
    torch.testing.assert_close(logp.grad, grads / num_tokens, **TOL)
    ratio = (logp.detach() - rollout).exp()
    outside = mask & ((ratio < 1 - eps_low) | (ratio > 1 + eps_high))
    assert (logp.grad[outside] == 0).all() and (logp.grad[~mask] == 0).all()
    n = mask.sum()
    assert metrics["actor/dis_masked_low_frac"].item() == pytest.approx(float((mask & (ratio < 1 - eps_low)).sum() / n))
    assert metrics["actor/dis_masked_high_frac"].item() == pytest.approx(float((mask & (ratio > 1 + eps_high)).sum() / n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dis_survives_log_prob_gaps_of_50(dtype):
    mask = torch.tensor([[True, True, True, True, False, False]])
    rollout = torch.tensor([[-1.0, -60.0, -1.0, -3.0, -1.0, 0.0]], dtype=dtype)
    logp = torch.tensor([[-51.0, -10.0, -1.1, -3.0, float("-inf"), float("nan")]], dtype=dtype, requires_grad=True)
    adv = torch.tensor([[5.0, -5.0, 2.0, 1.0, float("nan"), 1.0]], dtype=dtype)
    loss, metrics = dis_policy_loss(logp, rollout, adv, mask, eps_low=0.3, eps_high=5.0, num_tokens=4)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    ratio = torch.tensor([0.0, 0.0, (-0.1 * torch.ones((), dtype=torch.float64)).exp().item(), 1.0])
    expected = torch.tensor([[0.0, 0.0, -ratio[2] * 2.0 / 4, -1.0 / 4, 0.0, 0.0]], dtype=dtype)
    torch.testing.assert_close(logp.grad, expected)
    assert metrics["actor/dis_masked_low_frac"].item() == 0.25 and metrics["actor/dis_masked_high_frac"].item() == 0.25


@pytest.mark.parametrize("eps_low,eps_high", [(0.3, 5.0), (0.8, 3.0)])
def test_dis_band_edges_are_exact(eps_low, eps_high):
    """Ratios a hair inside the band are kept, a hair outside are masked (band is closed)."""
    inside = [(1 - eps_low) * (1 + 1e-9), 1.0, (1 + eps_high) * (1 - 1e-9)]
    outside = [(1 - eps_low) * (1 - 1e-9), (1 + eps_high) * (1 + 1e-9)]
    ratios = torch.tensor([inside + outside], dtype=torch.float64)
    rollout = torch.full_like(ratios, -1.0)
    logp = (rollout + ratios.log()).requires_grad_()
    loss, metrics = dis_policy_loss(logp, rollout, torch.ones_like(ratios), torch.ones_like(ratios),
                                    eps_low=eps_low, eps_high=eps_high, num_tokens=1)
    loss.backward()
    torch.testing.assert_close(logp.grad, -ratios * torch.tensor([[1.0, 1, 1, 0, 0]], dtype=torch.float64), **TOL)
    assert metrics["actor/dis_masked_low_frac"].item() == metrics["actor/dis_masked_high_frac"].item() == 0.2


@PROPS
@given(st.lists(st.tuples(st.floats(-60, 60), st.floats(-5, 5), st.booleans()), min_size=1, max_size=40),
       st.floats(0.0, 1.0), st.floats(0.0, 10.0))
def test_dis_property_gradient_is_ratio_times_advantage_inside_band_zero_outside(tokens, eps_low, eps_high):
    gaps, advs, keep = zip(*tokens)
    rollout = torch.full((1, len(gaps)), -2.0, dtype=torch.float64)
    logp = (rollout + torch.tensor([gaps], dtype=torch.float64)).requires_grad_()
    adv, mask = torch.tensor([advs], dtype=torch.float64), torch.tensor([keep])
    loss, metrics = dis_policy_loss(logp, rollout, adv, mask, eps_low=eps_low, eps_high=eps_high, num_tokens=7)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
    fn = lambda lp, rl, a: ref.dis_token(lp, rl, a, eps_low, eps_high)  # noqa: E731
    _, grads = _per_token_reference(fn, logp.detach(), rollout, adv, mask=mask)
    torch.testing.assert_close(logp.grad, grads / 7, **TOL)


def test_dis_rejects_bad_band_and_shapes():
    logp, rollout, adv, mask = _batch(seed=2)
    with pytest.raises(ValueError, match="eps_low"):
        dis_policy_loss(logp, rollout, adv, mask, eps_low=1.5, eps_high=1.0, num_tokens=1)
    with pytest.raises(ValueError, match="shape"):
        dis_policy_loss(logp, rollout[:, :-1], adv, mask, eps_low=0.2, eps_high=1.0, num_tokens=1)


# ------------------------------------------------------------------------------------ aggregation

@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_aggregation_matches_reference_and_splits_over_micro_batches(agg):
    gen = torch.Generator().manual_seed(0)
    per_token = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    mask = ref.multi_turn_mask(random.Random(0), 6, 9)
    mask[0] = False  # a sample without action tokens contributes 0
    rows = [[x for x, m in zip(p, k) if m] for p, k in zip(per_token.tolist(), mask.tolist())]
    num_tokens, num_sequences = int(mask.sum()), 6
    expected = {"token_mean": sum(map(sum, rows)) / num_tokens,
                "seq_mean_token_mean": sum(sum(r) / len(r) for r in rows if r) / num_sequences,
                "seq_mean_token_sum": sum(map(sum, rows)) / num_sequences}[agg]
    counts = dict(num_tokens=num_tokens, num_sequences=num_sequences)
    full = aggregate_loss(per_token, mask, agg=agg, **counts)
    assert full.item() == pytest.approx(expected, rel=1e-12)
    # Micro-batches normalised by the global counts sum to the full-batch loss.
    parts = sum(aggregate_loss(per_token[i:i + 2], mask[i:i + 2], agg=agg, **counts) for i in range(0, 6, 2))
    assert parts.item() == pytest.approx(expected, rel=1e-12)


def test_aggregation_needs_its_count():
    x, m = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate_loss(x, m, agg="token_mean", num_sequences=2)
    with pytest.raises(ValueError, match="num_sequences"):
        aggregate_loss(x, m, agg="seq_mean_token_mean", num_tokens=6)
    with pytest.raises(ValueError, match="> 0"):
        aggregate_loss(x, m, agg="token_mean", num_tokens=0)
    with pytest.raises(ValueError, match="token_mean"):
        aggregate_loss(x, m, agg="sum", num_tokens=6)
    assert aggregate_loss(x, m, agg="token_mean", num_tokens=torch.tensor(12.0)).item() == 0.5


def test_dis_seq_mean_token_mean_uses_per_sequence_action_counts():
    logp, rollout, adv, mask = _batch(seed=4, gap=0.1)
    loss, _ = dis_policy_loss(logp, rollout, adv, mask, eps_low=0.3, eps_high=5.0, num_tokens=None,
                              agg="seq_mean_token_mean", num_sequences=10)
    fn = lambda lp, rl, a: ref.dis_token(lp, rl, a, 0.3, 5.0)  # noqa: E731
    losses, _ = _per_token_reference(fn, logp.detach(), rollout, adv, mask=mask)
    expected = sum(losses[b].sum() / max(int(mask[b].sum()), 1) for b in range(mask.shape[0])) / 10
    torch.testing.assert_close(loss.detach(), torch.as_tensor(expected, dtype=torch.float64), **TOL)


# ------------------------------------------------------------------------------------------- PPO

@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_clip_matches_reference(dual_clip):
    logp, old, adv, mask = _batch(seed=3, gap=0.6)
    logp.data[0, :3] = old[0, :3] + 2.0  # ratio e^2 > dual clip 3 with some negative advantages
    adv[0, :3] = -1.0
    mask[0, :3] = True
    loss, metrics = ppo_clip_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, num_tokens=50,
                                         dual_clip=dual_clip)
    loss.backward()
    per_token = torch.zeros(mask.shape, dtype=torch.float64)
    grads, clipped = torch.zeros_like(per_token), torch.zeros(mask.shape, dtype=torch.bool)
    for b, t in mask.nonzero().tolist():
        per_token[b, t], grads[b, t], clipped[b, t] = ref.ppo_token(
            float(logp.detach()[b, t]), float(old[b, t]), float(adv[b, t]), 0.2, 0.28, dual_clip)
    torch.testing.assert_close(loss.detach(), per_token.sum() / 50, **TOL)
    torch.testing.assert_close(logp.grad, grads / 50, **TOL)
    assert metrics["actor/clip_frac"].item() == pytest.approx(float(clipped.sum() / mask.sum()))
    if dual_clip is not None:
        assert metrics["actor/clip_frac_dual"].item() > 0


def test_ppo_is_finite_for_huge_gaps_and_nan_padding():
    logp = torch.tensor([[-80.0, 0.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[0.0, -80.0, 0.0]])
    adv = torch.tensor([[1.0, -1.0, float("nan")]])
    mask = torch.tensor([[True, True, False]])
    loss, metrics = ppo_clip_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, num_tokens=2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and logp.grad[0, 2] == 0
    assert all(torch.isfinite(v) for v in metrics.values())
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, num_tokens=2, dual_clip=0.5)


# ----------------------------------------------------------------------------------------- value

@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_matches_reference(clip):
    gen = torch.Generator().manual_seed(5)
    mask = ref.multi_turn_mask(random.Random(5), 4, 20)
    values = torch.randn(4, 20, generator=gen, dtype=torch.float64, requires_grad=True)
    old = values.detach() + 0.3 * torch.randn(4, 20, generator=gen, dtype=torch.float64)
    returns = torch.randn(4, 20, generator=gen, dtype=torch.float64)
    loss, metrics = value_loss(values, returns, mask, num_tokens=100, old_values=old, clip=clip)
    loss.backward()
    expected, grads, n_clipped = 0.0, torch.zeros(4, 20, dtype=torch.float64), 0
    for b, t in mask.nonzero().tolist():
        v, o, g = float(values.detach()[b, t]), float(old[b, t]), float(returns[b, t])
        plain = 0.5 * (v - g) ** 2
        if clip is None:
            expected, grads[b, t] = expected + plain, v - g
            continue
        vc = o + min(max(v - o, -clip), clip)
        clipped = 0.5 * (vc - g) ** 2
        n_clipped += clipped > plain
        expected += max(plain, clipped)
        grads[b, t] = (v - g) if plain >= clipped else ((vc - g) if abs(v - o) < clip else 0.0)
    assert loss.item() == pytest.approx(expected / 100, rel=1e-12)
    torch.testing.assert_close(values.grad, grads / 100, **TOL)
    if clip is not None:
        assert metrics["critic/vf_clipfrac"].item() == pytest.approx(n_clipped / int(mask.sum()))


def test_value_loss_clip_needs_old_values_and_ignores_nan_padding():
    values = torch.tensor([[1.0, float("nan")]], requires_grad=True)
    returns = torch.tensor([[0.0, float("nan")]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, _ = value_loss(values, returns, mask, num_tokens=1)
    loss.backward()
    assert loss.item() == 0.5 and values.grad.tolist() == [[1.0, 0.0]]
    with pytest.raises(ValueError, match="old_values"):
        value_loss(values, returns, mask, num_tokens=1, clip=0.2)
