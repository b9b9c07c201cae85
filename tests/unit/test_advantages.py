"""GAE (skip-observation and plain), the blocked scan, GRPO advantages and the running-mean baseline,
each against slow reference loops (algo_reference.py) and closed forms."""

from __future__ import annotations

import functools
import math
import random

import numpy as np
import pytest
import scipy.signal
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import algo_reference as ref
from sao_megatron.algorithms import advantages as advantages_module
from sao_megatron.algorithms.advantages import (
    RunningMeanBaseline, broadcast_outcome_advantages, discounted_reverse_cumsum, gae, gae_value_mask,
    grpo_advantages, running_mean_baseline,
)

pytestmark = pytest.mark.unit
PROPS = settings(max_examples=60, deadline=None, derandomize=True)
# Both GAE implementations run every GAE test: the fused CPU kernel (the CPU default) and the
# vectorised scan (the accelerator path, also runnable on CPU).
IMPLS = ("kernel", "scan")
GAE = {impl: functools.partial(gae, impl=impl) for impl in IMPLS}


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-9) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


def _random_batch(seed: int, batch: int, length: int, *, obs_rewards: bool = True):
    rng = random.Random(seed)
    mask = ref.multi_turn_mask(rng, batch, length)
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    if not obs_rewards:
        rewards = rewards * mask
    return rewards, values, mask


# ------------------------------------------------------------------------------------------- scan

@pytest.mark.parametrize("chunk", [2, 3, 16])
@pytest.mark.parametrize("discount", [0.0, 0.5, 0.97, 1.0])
@pytest.mark.parametrize("length", [1, 2, 3, 16, 17, 100, 1000])
def test_scan_matches_loop(chunk, discount, length):
    x = torch.randn(3, length, dtype=torch.float64, generator=torch.Generator().manual_seed(length))
    expected = torch.tensor([ref.reverse_scan(row, discount) for row in x.tolist()], dtype=torch.float64)
    _close(discounted_reverse_cumsum(x, discount, chunk=chunk), expected)


@pytest.mark.parametrize("discount", [1.0, 0.999, 0.9405, 0.5, 1e-3, 0.0])
def test_scan_is_stable_at_64k_in_float32(discount):
    """No overflow/underflow to inf/NaN, and float32 accuracy against a float64 IIR filter."""
    length = 65536
    x = torch.randn(2, length, generator=torch.Generator().manual_seed(0))
    out = discounted_reverse_cumsum(x, discount)
    expected = scipy.signal.lfilter([1.0], [1.0, -discount], x.double().numpy()[:, ::-1], axis=1)[:, ::-1]
    expected = torch.from_numpy(expected.copy())
    assert torch.isfinite(out).all()
    # Measured max error: 4e-7 of the scale at discount 1 (fp32 eps 1.2e-7); 10x margin.
    scale = expected.abs().max().item() + 1.0
    assert (out.double() - expected).abs().max().item() < 4e-6 * scale


def test_scan_rejects_bad_discount():
    with pytest.raises(ValueError, match="discount"):
        discounted_reverse_cumsum(torch.zeros(1, 4), 1.5)


# -------------------------------------------------------------------------------------------- GAE

@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.7), (1.0, 0.5)])
@pytest.mark.parametrize("impl", IMPLS)
def test_gae_matches_reference_on_multi_turn_masks(impl, skip, gamma, lam):
    rewards, values, mask = _random_batch(seed=7, batch=6, length=90)
    adv, ret = GAE[impl](rewards, values, mask, gamma=gamma, lam=lam, skip_observations=skip)
    ref_adv, ref_ret = ref.gae(rewards, values, mask, gamma, lam, skip)
    _close(adv, ref_adv)
    _close(ret, ref_ret)


@pytest.mark.parametrize("impl", IMPLS)
def test_gae_long_multi_turn_rows_match_reference(impl, monkeypatch):
    """Long rows exercise three scan levels; a small block size makes each row its own CPU block."""
    monkeypatch.setattr(advantages_module, "_CPU_BLOCK_ELEMENTS", 8000)
    rng = random.Random(3)
    mask = ref.multi_turn_mask(rng, 3, 6000, min_run=1, max_run=300)
    values = torch.randn(3, 6000, dtype=torch.float64)
    rewards = torch.randn(3, 6000, dtype=torch.float64) * (torch.rand(3, 6000) < 0.01)
    for skip in (True, False):
        adv, ret = GAE[impl](rewards, values, mask, gamma=0.999, lam=0.97, skip_observations=skip)
        ref_adv, ref_ret = ref.gae(rewards, values, mask, 0.999, 0.97, skip)
        _close(adv, ref_adv, 1e-8)
        _close(ret, ref_ret, 1e-8)


@pytest.mark.parametrize("impl", IMPLS)
def test_gae_float32_and_mask_dtypes(impl):
    rewards, values, mask = _random_batch(seed=1, batch=4, length=50)
    expected = ref.gae(rewards, values, mask, 0.99, 0.95)
    for m in (mask, mask.float(), mask.long()):
        adv, ret = GAE[impl](rewards.float(), values.float(), m, gamma=0.99, lam=0.95)
        assert adv.dtype == ret.dtype == torch.float32
        _close(adv, expected[0], 1e-5)
        _close(ret, expected[1], 1e-5)
    adv, _ = GAE[impl](rewards.bfloat16(), values.bfloat16(), mask, gamma=0.99, lam=0.95)
    assert adv.dtype == torch.float32


def _skip_closed_form(rewards, values, mask, gamma, lam):
    """Per row: compacted actions, folded rewards; returns (delta, discounted return) per action position."""
    out = []
    for r, v, m in zip(rewards.tolist(), values.tolist(), mask.tolist()):
        acts = [t for t, x in enumerate(m) if x]
        folded = ref.fold_rewards(r, m)
        rs, vs = [folded[a] for a in acts], [v[a] for a in acts]
        deltas = [rs[k] + gamma * (vs[k + 1] if k + 1 < len(acts) else 0.0) - vs[k] for k in range(len(acts))]
        mc = ref.reverse_scan(rs, gamma)
        out.append((acts, deltas, mc, vs))
    return out


@st.composite
def gae_cases(draw):
    batch, length = draw(st.integers(1, 3)), draw(st.integers(1, 40))
    mask = draw(st.lists(st.lists(st.booleans(), min_size=length, max_size=length), min_size=batch, max_size=batch))
    floats = st.floats(-10, 10, allow_nan=False)
    grid = st.lists(st.lists(floats, min_size=length, max_size=length), min_size=batch, max_size=batch)
    gamma, lam = draw(st.floats(0, 1)), draw(st.floats(0, 1))
    return (torch.tensor(draw(grid), dtype=torch.float64), torch.tensor(draw(grid), dtype=torch.float64),
            torch.tensor(mask, dtype=torch.bool), gamma, lam)


@PROPS
@given(gae_cases(), st.booleans())
@pytest.mark.parametrize("impl", IMPLS)
def test_gae_property_matches_reference(impl, case, skip):
    rewards, values, mask, gamma, lam = case
    adv, ret = GAE[impl](rewards, values, mask, gamma=gamma, lam=lam, skip_observations=skip)
    ref_adv, ref_ret = ref.gae(rewards, values, mask, gamma, lam, skip)
    _close(adv, ref_adv, 1e-8)
    _close(ret, ref_ret, 1e-8)
    value_mask = torch.tensor([ref.value_mask_row(m, skip) for m in mask.tolist()], dtype=torch.bool).reshape(mask.shape)
    assert (adv[~mask] == 0).all() and (ret[~value_mask] == 0).all()
    assert torch.equal(gae_value_mask(mask, skip_observations=skip), value_mask)


@PROPS
@given(gae_cases())
@pytest.mark.parametrize("impl", IMPLS)
def test_gae_lam_zero_and_one_closed_forms(impl, case):
    """λ=0: Â_k = δ_k. λ=1: Â_k = Σ_j γ^(j−k) r_j − V_k (Monte-Carlo return minus value), G_k = that return."""
    rewards, values, mask, gamma, _ = case
    adv0, _ = GAE[impl](rewards, values, mask, gamma=gamma, lam=0.0)
    adv1, ret1 = GAE[impl](rewards, values, mask, gamma=gamma, lam=1.0)
    for b, (acts, deltas, mc, vs) in enumerate(_skip_closed_form(rewards, values, mask, gamma, 0.0)):
        _close(adv0[b, acts], torch.tensor(deltas, dtype=torch.float64).reshape(-1))
        _close(adv1[b, acts], torch.tensor([g - v for g, v in zip(mc, vs)], dtype=torch.float64).reshape(-1), 1e-8)
        _close(ret1[b, acts], torch.tensor(mc, dtype=torch.float64).reshape(-1), 1e-8)


@PROPS
@given(gae_cases())
@pytest.mark.parametrize("impl", IMPLS)
def test_gae_variants_agree_without_discount(impl, case):
    """γ = λ = 1: both variants give G_t = (sum of rewards from t on) and Â_t = G_t − V_t on the actions
    (plain GAE also has returns at the observation steps between them)."""
    rewards, values, mask, _, _ = case
    skip = GAE[impl](rewards, values, mask, gamma=1.0, lam=1.0, skip_observations=True)
    plain = GAE[impl](rewards, values, mask, gamma=1.0, lam=1.0, skip_observations=False)
    _close(skip[0], plain[0], 1e-8)
    _close(skip[1], plain[1] * mask, 1e-8)


@PROPS
@given(gae_cases(), st.integers(0, 7), st.booleans())
@pytest.mark.parametrize("impl", IMPLS)
def test_gae_left_vs_right_padding(impl, case, pad, skip):
    rewards, values, mask, gamma, lam = case
    length = rewards.shape[1]
    right = [torch.nn.functional.pad(x, (0, pad)) for x in (rewards, values, mask)]
    left = [torch.nn.functional.pad(x, (pad, 0)) for x in (rewards, values, mask)]
    right_out = GAE[impl](*right, gamma=gamma, lam=lam, skip_observations=skip)
    left_out = GAE[impl](*left, gamma=gamma, lam=lam, skip_observations=skip)
    for r_out, l_out in zip(right_out, left_out):
        _close(r_out[:, :length], l_out[:, pad:], 1e-8)


@pytest.mark.parametrize("impl", IMPLS)
def test_gae_mask_edge_cases(impl):
    rewards = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.25, 0.125, 1.0, 2.0]], dtype=torch.float64)
    for skip in (True, False):
        adv, ret = GAE[impl](rewards, values, torch.zeros(1, 5, dtype=torch.bool), gamma=0.9, lam=0.8, skip_observations=skip)
        assert (adv == 0).all() and (ret == 0).all()
        # One action token: Â = (its reward + every later reward, folded) − V, whatever γ and λ.
        one = torch.tensor([[False, True, False, False, False]])
        adv, ret = GAE[impl](rewards, values, one, gamma=0.9, lam=0.8, skip_observations=skip)
        _close(adv, torch.tensor([[0.0, 2 + 3 + 4 + 5 - 0.25, 0, 0, 0]], dtype=torch.float64))
        _close(ret, torch.tensor([[0.0, 14.0, 0, 0, 0]], dtype=torch.float64))
    # All actions: no observation to skip, so both variants agree with the plain recursion.
    ones = torch.ones(1, 5, dtype=torch.bool)
    _close(GAE[impl](rewards, values, ones, gamma=0.9, lam=0.8)[0], GAE[impl](rewards, values, ones, gamma=0.9, lam=0.8,
                                                                   skip_observations=False)[0])


_row = st.integers(1, 30).flatmap(lambda n: st.tuples(
    st.lists(st.floats(-10, 10), min_size=n, max_size=n), st.lists(st.floats(-10, 10), min_size=n, max_size=n)))


def _t(xs) -> torch.Tensor:
    return torch.tensor([xs], dtype=torch.float64)


@PROPS
@given(_row, st.floats(0, 1), st.floats(0, 1), st.booleans(), st.data())
@pytest.mark.parametrize("impl", IMPLS)
def test_gae_property_zero_one_and_single_action_masks(impl, row, gamma, lam, skip, data):
    rewards, values = _t(row[0]), _t(row[1])
    length = rewards.shape[1]
    adv, ret = GAE[impl](rewards, values, torch.zeros(1, length), gamma=gamma, lam=lam, skip_observations=skip)
    assert (adv == 0).all() and (ret == 0).all()
    ones = torch.ones(1, length)  # nothing to skip: both variants are the plain recursion
    expected = ref.gae(rewards, values, ones, gamma, lam, skip_observations=False)
    for out, exp in zip(GAE[impl](rewards, values, ones, gamma=gamma, lam=lam, skip_observations=skip), expected):
        _close(out, exp, 1e-8)
    # One action token at p: Â = (reward at p + every later reward, folded) − V[p], whatever γ and λ.
    p = data.draw(st.integers(0, length - 1))
    single = torch.zeros(1, length, dtype=torch.bool)
    single[0, p] = True
    adv, ret = GAE[impl](rewards, values, single, gamma=gamma, lam=lam, skip_observations=skip)
    tail = rewards[0, p:].sum()
    _close(adv[0, p], tail - values[0, p], 1e-8)
    _close(ret[0, p], tail, 1e-8)
    assert adv.count_nonzero() <= 1 and ret.count_nonzero() <= 1


@PROPS
@given(gae_cases(), st.integers(0, 6), st.integers(0, 6), st.booleans(), st.data())
@pytest.mark.parametrize("impl", IMPLS)
def test_gae_property_observation_runs_at_start_and_end(impl, case, head, tail, skip, data):
    """Observation runs before the first / after the last action: rewards before are dropped (values too),
    rewards after fold into the last action, so the result equals the core row with the tail's rewards
    moved onto its last position."""
    rewards, values, mask, gamma, lam = case
    batch = rewards.shape[0]
    floats = st.lists(st.floats(-10, 10), min_size=batch * (head + tail), max_size=batch * (head + tail))
    extra_r = torch.tensor(data.draw(floats), dtype=torch.float64).reshape(batch, head + tail)
    extra_v = torch.tensor(data.draw(floats), dtype=torch.float64).reshape(batch, head + tail)
    wrapped = [torch.cat([e[:, :head], x, e[:, head:]], dim=1)
               for e, x in ((extra_r, rewards), (extra_v, values), (torch.zeros(batch, head + tail), mask.double()))]
    out = GAE[impl](*wrapped, gamma=gamma, lam=lam, skip_observations=skip)
    folded = rewards.clone()
    folded[:, -1] += extra_r[:, head:].sum(dim=1)
    expected = GAE[impl](folded, values, mask, gamma=gamma, lam=lam, skip_observations=skip)
    length = rewards.shape[1]
    for o, e in zip(out, expected):
        _close(o[:, head:head + length], e, 1e-8)
        assert (o[:, :head] == 0).all() and (o[:, head + length:] == 0).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_gae_observation_runs_at_start_and_end(impl):
    """Rewards before the first action are dropped; those after the last action fold into it."""
    mask = torch.tensor([[False, False, True, True, False, True, False, False]])
    rewards = torch.tensor([[7.0, 7.0, 0.0, 1.0, 0.0, 2.0, 0.0, 3.0]], dtype=torch.float64)
    values = torch.tensor([[9.0, 9.0, 0.5, 0.25, 9.0, 0.125, 9.0, 9.0]], dtype=torch.float64)
    adv, ret = GAE[impl](rewards, values, mask, gamma=1.0, lam=1.0)
    # Returns: action 5 gets 2 + 3 (folded), action 3 gets 1 + 5, action 2 gets 6.
    _close(ret, torch.tensor([[0, 0, 6.0, 6.0, 0, 5.0, 0, 0]], dtype=torch.float64))
    _close(adv, ret - values * mask)


@pytest.mark.parametrize("impl", IMPLS)
def test_gae_skip_never_reads_observation_values(impl):
    rewards, values, mask = _random_batch(seed=5, batch=4, length=60)
    garbage = torch.where(mask, values, torch.full_like(values, 1e30))
    for out, expected in zip(GAE[impl](rewards, garbage, mask, gamma=0.97, lam=0.9), GAE[impl](rewards, values, mask, gamma=0.97, lam=0.9)):
        _close(out, expected, 0.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_plain_gae_returns_at_observation_steps(impl):
    """Plain token GAE (issue 16): the observation tokens between turns are steps, so they get the
    returns G_t = Â_t + V_t that standard token-level GAE trains the critic on; the prompt before
    the first action and the tokens after the last get none. A hand-built row against the slow loop."""
    mask = torch.tensor([[False, False, True, False, False, True, True, False, True, False]])
    rewards = torch.tensor([[5.0, 0, 0, 0.5, 0, 0, 0, 0, 1.0, 2.0]], dtype=torch.float64)
    values = torch.tensor([[3.0, 3.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 9.0]], dtype=torch.float64)
    gamma, lam = 0.9, 0.8
    adv, ret = GAE[impl](rewards, values, mask, gamma=gamma, lam=lam, skip_observations=False)
    # The slow loop, written out: steps 2..8, reward 0.5 folded into step 2 and 2.0 into step 8.
    r = {2: 0.5, 8: 3.0}
    running, nxt, expected = 0.0, 0.0, [0.0] * 10
    for t in range(8, 1, -1):
        running = r.get(t, 0.0) + gamma * nxt - float(values[0, t]) + gamma * lam * running
        nxt = float(values[0, t])
        expected[t] = running + nxt
    _close(ret, torch.tensor([expected], dtype=torch.float64))
    assert ret[0, 3] != 0 and ret[0, 4] != 0 and ret[0, 7] != 0  # the observation steps have targets
    _close(adv, (ret - values) * mask)
    assert gae_value_mask(mask, skip_observations=False).tolist() == [[t in range(2, 9) for t in range(10)]]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("impl", IMPLS)
def test_gae_exact_on_dyadic_inputs(impl, skip):
    """With γ = λ = 1/2 and rewards/values on a 1/8 grid every operation is exact in float64, so both
    implementations must equal the slow loop bit for bit, skip-observation returns included (they
    stay on the action tokens only: the plain mode's new returns at observation steps leave them be)."""
    rng = random.Random(4)
    mask = ref.multi_turn_mask(rng, 8, 14, max_run=3)
    gen = torch.Generator().manual_seed(4)
    rewards = torch.randint(-16, 17, (8, 14), generator=gen).double() / 8
    values = torch.randint(-16, 17, (8, 14), generator=gen).double() / 8
    adv, ret = GAE[impl](rewards, values, mask, gamma=0.5, lam=0.5, skip_observations=skip)
    ref_adv, ref_ret = ref.gae(rewards, values, mask, 0.5, 0.5, skip)
    _close(adv, ref_adv, 0.0)
    _close(ret, ref_ret, 0.0)
    if skip:
        assert (ret[~mask] == 0).all()


def _numpy_skip_gae(rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, gamma: float, lam: float):
    """Independent float64 reference for long rows: numpy compaction + scipy IIR filter."""
    adv = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        acts = np.flatnonzero(mask[b])
        owner = np.searchsorted(acts, np.arange(rewards.shape[1]), side="right") - 1
        folded = np.bincount(owner[owner >= 0], weights=rewards[b][owner >= 0], minlength=len(acts))
        vs = values[b, acts]
        delta = folded + gamma * np.append(vs[1:], 0.0) - vs
        adv[b, acts] = scipy.signal.lfilter([1.0], [1.0, -gamma * lam], delta[::-1])[::-1]
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.999, 0.99), (0.99, 0.95)])
@pytest.mark.parametrize("impl", IMPLS)
def test_gae_64k_stable_in_float32(impl, gamma, lam):
    rng = random.Random(11)
    mask = ref.multi_turn_mask(rng, 2, 65536, min_run=50, max_run=2000)
    mask[:, :100] = True  # both rows long
    gen = torch.Generator().manual_seed(11)
    values = torch.randn(2, 65536, generator=gen)
    rewards = (torch.rand(2, 65536, generator=gen) < 1e-3) * torch.randn(2, 65536, generator=gen)
    adv, ret = GAE[impl](rewards, values, mask, gamma=gamma, lam=lam)
    expected = _numpy_skip_gae(rewards.double().numpy(), values.double().numpy(), mask.numpy(), gamma, lam)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    scale = np.abs(expected).max() + 1.0  # measured: 1.8e-5 absolute at scale 13 for gamma = lam = 1
    assert np.abs(adv.double().numpy() - expected).max() < 1e-5 * scale


@pytest.mark.parametrize("impl", IMPLS)
def test_gae_validates_inputs(impl):
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="gamma"):
        GAE[impl](x, x, x, gamma=1.1, lam=0.9)
    with pytest.raises(ValueError, match="lam"):
        GAE[impl](x, x, x, gamma=0.9, lam=-0.1)
    with pytest.raises(ValueError, match="shape"):
        GAE[impl](x, torch.zeros(2, 4), x, gamma=0.9, lam=0.9)
    adv, ret = GAE[impl](torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3), gamma=1.0, lam=1.0)
    assert adv.shape == ret.shape == (0, 3)
    adv, _ = GAE[impl](torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0), gamma=1.0, lam=1.0)
    assert adv.shape == (2, 0)


def test_gae_kernel_threads_split_rows_bit_identically():
    """Rows split over threads (uneven ranges) give exactly the single-thread result, and agree with the scan."""
    from sao_megatron.algorithms import gae_cpu

    rewards, values, mask = _random_batch(seed=21, batch=7, length=30_000)
    rewards, values = rewards.float(), values.float()
    for skip in (True, False):
        one = gae_cpu.gae_rows(rewards, values, mask, gamma=0.99, lam=0.95, skip_observations=skip, num_threads=1)
        three = gae_cpu.gae_rows(rewards, values, mask, gamma=0.99, lam=0.95, skip_observations=skip, num_threads=3)
        # The scan in float64 as the reference: the kernel accumulates in float64 and rounds once.
        scan = gae(rewards.double(), values.double(), mask, gamma=0.99, lam=0.95, skip_observations=skip, impl="scan")
        for a, b, c in zip(one, three, scan):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, c.float(), rtol=1e-6, atol=1e-6)


def test_gae_kernel_accepts_views_and_grad_tensors():
    rewards, values, mask = _random_batch(seed=4, batch=5, length=40)
    expected = ref.gae(rewards, values, mask, 0.9, 0.8)
    transposed = [x.t().contiguous().t() for x in (rewards, values, mask)]  # column-major views
    values_grad = values.clone().requires_grad_(True)
    for args in (transposed, (rewards, values_grad, mask)):
        adv, ret = gae(*args, gamma=0.9, lam=0.8, impl="kernel")
        _close(adv, expected[0])
        _close(ret, expected[1])
        assert not adv.requires_grad


@pytest.mark.parametrize("impl", IMPLS)
def test_gae_writes_into_out_buffers(impl):
    rewards, values, mask = _random_batch(seed=8, batch=4, length=70)
    expected = ref.gae(rewards, values, mask, 0.95, 0.9)
    out = (torch.full_like(rewards, float("nan")), torch.full_like(rewards, float("nan")))  # stale contents
    adv, ret = GAE[impl](rewards, values, mask, gamma=0.95, lam=0.9, out=out)
    assert adv.data_ptr() == out[0].data_ptr() and ret.data_ptr() == out[1].data_ptr()
    _close(out[0], expected[0])
    _close(out[1], expected[1])
    with pytest.raises(ValueError, match="contiguous"):
        GAE[impl](rewards, values, mask, gamma=0.95, lam=0.9, out=(out[0].float(), out[1]))
    with pytest.raises(ValueError, match="different tensors"):
        GAE[impl](rewards, values, mask, gamma=0.95, lam=0.9, out=(out[0], out[0]))


def test_gae_impl_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="impl must be one of"):
        gae(x, x, x, gamma=0.9, lam=0.9, impl="loop")
    meta = torch.zeros(2, 3, device="meta")
    with pytest.raises(ValueError, match="CPU tensors only"):
        gae(meta, meta, meta, gamma=0.9, lam=0.9, impl="kernel")


# ------------------------------------------------------------------------------ outcome baselines

def _grpo_reference(rewards: list[float], groups: list[int], eps: float, normalize_std: bool) -> list[float]:
    out = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1)) if len(members) > 1 else 0.0
        out.append((r - mean) / (std + eps) if normalize_std else r - mean)
    return out


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_matches_reference_with_unsorted_sparse_group_ids(normalize_std):
    rng = random.Random(0)
    groups = [rng.choice([3, 17, -4, 1000, 42]) for _ in range(40)] + [99]  # 99: a group of one
    rewards = [rng.choice([0.0, 1.0]) + rng.random() * 0.1 for _ in groups]
    out = grpo_advantages(torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups), normalize_std=normalize_std)
    _close(out, torch.tensor(_grpo_reference(rewards, groups, 1e-6, normalize_std), dtype=torch.float64))
    assert out[-1] == 0.0


def test_grpo_identical_rewards_give_zero_and_shape_errors():
    out = grpo_advantages(torch.ones(8), torch.tensor([0] * 4 + [1] * 4))
    assert (out == 0).all()
    with pytest.raises(ValueError, match="same"):
        grpo_advantages(torch.ones(8), torch.zeros(7, dtype=torch.long))


def test_broadcast_outcome_advantages():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    out = broadcast_outcome_advantages(torch.tensor([2.0, -1.0]), mask)
    assert out.tolist() == [[2.0, 2.0, 0.0], [0.0, -1.0, -1.0]]


def test_running_mean_baseline_exact_mean_and_checkpoint():
    batches = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0]), torch.tensor([-4.0, 0.0])]
    base = running_mean_baseline(momentum=None)
    seen = []
    for batch in batches:
        expected_b = sum(seen) / len(seen) if seen else 0.0
        _close(base.advantages(batch), batch.double() - expected_b)
        base.update(batch)
        seen += batch.tolist()
        assert base.value == pytest.approx(sum(seen) / len(seen))
    restored = RunningMeanBaseline(momentum=None)
    restored.load_state_dict(base.state_dict())
    assert (restored.value, restored.count) == (base.value, base.count)


def test_running_mean_baseline_ema():
    base = RunningMeanBaseline(momentum=0.9)
    base.update(torch.tensor([2.0, 4.0]))  # first batch initialises to its mean
    assert base.value == pytest.approx(3.0)
    base.update(torch.tensor([13.0]))
    assert base.value == pytest.approx(0.9 * 3.0 + 0.1 * 13.0)
    with pytest.raises(ValueError, match="momentum"):
        RunningMeanBaseline(momentum=0.5).load_state_dict(base.state_dict())
    with pytest.raises(ValueError, match="momentum"):
        RunningMeanBaseline(momentum=1.0)
    with pytest.raises(ValueError, match="non-finite"):
        base.update(torch.tensor([float("nan")]))


@pytest.mark.gpu
@pytest.mark.parametrize("skip", [True, False])
def test_gae_on_cuda_matches_cpu(skip):
    """The single-block CUDA path (full width, no host read) agrees with the CPU path."""
    rewards, values, mask = _random_batch(seed=9, batch=8, length=3000, obs_rewards=False)
    cpu = gae(rewards.float(), values.float(), mask, gamma=0.99, lam=0.95, skip_observations=skip)
    cuda = gae(rewards.float().cuda(), values.float().cuda(), mask.cuda(), gamma=0.99, lam=0.95,
               skip_observations=skip)
    for a, b in zip(cpu, cuda):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-5)
