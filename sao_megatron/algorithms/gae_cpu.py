"""Fused single-pass GAE kernels for CPU tensors (numba), the CPU path of ``advantages.gae``.

Why a compiled kernel on CPU. GAE is a linear recurrence over each row; what the skip-observation
variant adds (fold rewards, skip observation tokens, bootstrap from the next turn's first action)
is a masked recurrence that no well-kept library provides. In eager PyTorch it takes a compaction
(scatter the actions into a dense block, scan, gather back): about a dozen passes over memory,
~19x a copy of the inputs at [128, 32768]. scipy.signal.lfilter (the library IIR filter) handles
only the plain constant-coefficient recurrence and is slower than our blocked scan. A numba
kernel reads each input once and writes each output once, walking every row backwards in
compiled code: ~2-4x the copy (benchmarks/advantages.py). Rows are independent, so they are split
across threads; the kernels release the GIL. On accelerators ``gae`` keeps the vectorised blocked
scan (thousands of rows in parallel on the device, no host round trip).

Arithmetic runs in float64 whatever the input dtype (same speed here: the loop is bound by loads
and stores, not by the FMA), so float32 results are the correctly rounded float64 recursion.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import torch

__all__ = ["gae_rows"]

# Below this many elements per thread, starting a thread costs more than it saves (~50 us vs
# ~2 ns per element).
_MIN_ELEMENTS_PER_THREAD = 1 << 16


@numba.njit(nogil=True, cache=True, fastmath={"contract"})
def _gae_rows_kernel(rewards, values, mask, gamma, gamma_lam, skip_observations, advantages, returns, lo, hi):
    """GAE for rows ``[lo, hi)``, walking each row backwards (docs/architecture.md#skip-observation-gae).

    ``skip_observations``: over the action positions ``a_1 < … < a_K``, ``δ_k = r[a_k] + γ V[a_{k+1}]
    − V[a_k]`` with ``V[a_{K+1}] = 0``, ``Â_k = δ_k + γλ Â_{k+1}``, ``G_k = Â_k + V[a_k]``;
    observation values are never read. Otherwise every position up to the row's last action token
    is a step (observation tokens: reward 0 after folding, their own values), the value after the
    last action is 0, and the observation steps after the row's first action get returns too
    (``advantages.gae_value_mask``). Either way a reward on a non-action token is folded into the
    last action before it (``pending``), one before the first action is dropped, advantages are 0
    off the mask and returns 0 off the value mask.
    """
    length = rewards.shape[1]
    for b in range(lo, hi):
        r, v, m, adv, ret = rewards[b], values[b], mask[b], advantages[b], returns[b]
        first = np.uint64(length)  # the row's first action token (plain mode only)
        if not skip_observations:
            for i in range(length):
                if m[i]:
                    first = np.uint64(i)
                    break
        pending = 0.0  # rewards seen since (after) the next action to the left
        next_value = 0.0  # V of the next step to the right (terminal: 0)
        last = 0.0  # Â of the next step to the right
        in_episode = False  # an action token at or after t
        t = np.uint64(length)
        while t > 0:  # an unsigned index: no negative-index wraparound check (1.5x faster, measured)
            t -= np.uint64(1)
            if m[t]:
                value = np.float64(v[t])
                last = (r[t] + pending + gamma * next_value - value) + gamma_lam * last
                adv[t] = last
                ret[t] = last + value
                next_value = value
                pending = 0.0
                in_episode = True
            else:
                pending += r[t]
                adv[t] = 0.0
                ret[t] = 0.0
                if in_episode and not skip_observations:  # an observation token is a step of its own
                    value = np.float64(v[t])
                    last = (gamma * next_value - value) + gamma_lam * last
                    next_value = value
                    if t > first:
                        ret[t] = last + value


def gae_rows(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float,
             skip_observations: bool, num_threads: int,
             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over CPU tensors ``[B, T]`` (rewards, values: contiguous, same float dtype; mask: bool).

    Returns ``(advantages, returns)`` in the input dtype: ``out`` (checked by the caller: contiguous,
    same shape and dtype) or fresh tensors. Rows are split into up to ``num_threads`` contiguous
    ranges; the caller's thread takes the first.
    """
    assert rewards.device.type == "cpu" and rewards.dtype == values.dtype and mask.dtype == torch.bool
    num_rows, length = rewards.shape
    if out is None:
        # Fresh outputs come from numpy, not torch.empty: numpy madvises allocations of 4 MiB and
        # more as transparent huge pages (the usual THP mode is `madvise`), torch does not. 4 KiB
        # pages fault one by one on first touch; measured on the CI VM, zero-filling two fresh
        # [128, 32768] float32 tensors: torch 8-24 ms, numpy 4-6 ms (the kernel itself: 5-6 ms).
        dtype = rewards.numpy().dtype
        out = tuple(torch.from_numpy(np.empty((num_rows, length), dtype=dtype)) for _ in range(2))
    if num_rows == 0 or length == 0:
        return out  # no elements
    arrays = [x.numpy() for x in (rewards, values, mask, *out)]
    num_threads = max(1, min(num_threads, num_rows, num_rows * length // _MIN_ELEMENTS_PER_THREAD))
    bounds = np.linspace(0, num_rows, num_threads + 1).round().astype(int).tolist()
    args = [(*arrays[:3], float(gamma), float(gamma * lam), bool(skip_observations), *arrays[3:], lo, hi)
            for lo, hi in zip(bounds, bounds[1:])]
    futures = [_worker_pool(os.getpid(), num_threads - 1).submit(_gae_rows_kernel, *a) for a in args[1:]]
    _gae_rows_kernel(*args[0])
    for future in futures:
        future.result()  # re-raises a worker's error
    return out


@functools.lru_cache(maxsize=8)
def _worker_pool(pid: int, num_workers: int) -> ThreadPoolExecutor:
    """Worker threads kept for the process: starting a thread costs 0.3-0.7 ms on the CI VM, as much
    as the whole kernel at [128, 4096]. Keyed by pid so that a forked child starts its own (the
    parent's threads do not exist there). Concurrent callers share it safely: workers only run
    kernels, never wait on other futures."""
    return ThreadPoolExecutor(num_workers, thread_name_prefix="sao-gae")
