"""Advantage estimators: skip-observation token-level GAE, GRPO group advantages, running-mean baseline.

Pure tensor maths (docs/architecture.md#the-algorithm). Tensors are ``[B, T]``: a batch of samples by trajectory tokens,
padded with ``action_mask == 0``. Advantages are 0 wherever ``action_mask == 0``; returns are 0
outside ``gae_value_mask`` (the action tokens, plus with plain token GAE the observation tokens
between a row's first and last action: standard token-level GAE treats those as steps and trains
the critic on them too).

Where rewards live. The scheduler puts the outcome reward on the last action token (per-turn rewards
on each turn's last action token). A reward found on a non-action token is *folded* into the closest
action token before it: it is received after that action and before the next one, so it belongs to
that transition's TD error. A reward before the first action token precedes every decision, cannot
change any advantage, and is dropped. Folding is sync-free (no ``.any()`` check on the device) and
gives both GAE variants the same rewards, so they agree when ``gamma == lam == 1``. On CUDA,
folding several non-zero rewards into one action adds them atomically (the last bit may differ
between runs); one reward per action, the scheduler's layout, is bit-exact everywhere.

Two implementations of one recursion (``gae(impl=...)``): on CPU tensors a fused single-pass numba
kernel (``gae_cpu``: one read of each input, one write of each output); elsewhere the vectorised
compaction + blocked scan below (no loop over time, thousands of rows in parallel on a GPU). Both
run every GAE test; ``benchmarks/advantages.py`` times them against a per-timestep loop and a copy.
numba is optional: where it cannot be imported (GPU images need not ship it) CPU tensors take the scan.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

__all__ = [
    "GAE_IMPLS", "RunningMeanBaseline", "broadcast_outcome_advantages", "discounted_reverse_cumsum", "gae",
    "gae_impl_for", "gae_value_mask", "grpo_advantages", "running_mean_baseline",
]

logger = logging.getLogger(__name__)

# Chunk length of the blocked scan. Measured on the 2-core CPU box (benchmarks/advantages.py scan
# table, [128, 32768] fp32, discount 0.94, best of 10, load average ~1): chunk 8: 3.8-4.6 ms,
# 16: 2.5-3.0 ms, 32: 2.4-2.9 ms, 64: 3.3-4.2 ms, 128: 4.9-5.5 ms (the chunk matmul costs ~chunk
# flops per element; shorter chunks add levels); copying the tensor takes 0.65 ms.
# scipy.signal.lfilter over the reversed rows (a well-kept IIR filter) takes 33-40 ms, ~13x
# slower than chunk 16, and is CPU-only: not used.
_CHUNK = 16
GAE_IMPLS = ("auto", "kernel", "scan")
_INNER_CHUNK = 64
# Elements per row block on CPU. Whole-batch temporaries (32 MB int64 at B=128, T=32k) are fresh
# mmaps that page-fault on every call (glibc returns blocks over 32 MB to the OS): 1.7x slower.
# Blocks of 2**17..2**20 elements were within 10% of each other on an idle box; 2**20 (fewer ops)
# was fastest when the 2 cores were oversubscribed.
_CPU_BLOCK_ELEMENTS = 1 << 20


def _power_matrix(discount: float, size: int, like: torch.Tensor) -> torch.Tensor:
    """See ``_power_matrix_cached`` (cached per discount, size, dtype and device; never written to)."""
    return _power_matrix_cached(discount, size, like.dtype, like.device)


@functools.lru_cache(maxsize=64)
def _power_matrix_cached(discount: float, size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``M[k, j] = discount**(k - j)`` for ``k >= j`` else 0, shape ``[size, size]``.

    ``x_chunk @ M`` is the within-chunk reverse discounted sum. Every power is in [0, 1] because
    ``0 <= discount <= 1``: nothing overflows. Powers below ``eps**2`` are set to 0: they change a
    sum by less than ``eps**2 * max|x|`` (far below rounding), and left in they become subnormal
    floats deep in the recursion (``discount**(16*64*...)``), which made the matmul ~50x slower.
    """
    k = torch.arange(size, dtype=torch.float64)
    lag = k[:, None] - k[None, :]
    powers = torch.pow(torch.tensor(discount, dtype=torch.float64), lag.clamp(min=0))
    keep = (lag >= 0) & (powers >= torch.finfo(dtype).eps ** 2)
    return torch.where(keep, powers, 0.0).to(dtype=dtype, device=device)


def discounted_reverse_cumsum(x: torch.Tensor, discount: float, *, chunk: int = _CHUNK) -> torch.Tensor:
    """``y[:, t] = sum_{k >= t} discount**(k - t) * x[:, k]``, i.e. ``y_t = x_t + discount * y_{t+1}``.

    x: ``[N, T]`` floating. Returns ``[N, T]`` (possibly a view of a fresh tensor). Blocked scan: a
    matmul with a ``chunk x chunk`` matrix of powers inside each chunk, the same scan recursively over
    the chunk starts (factor ``discount**chunk``), then one fused multiply-add carrying the next
    chunk's value in. Recursion depth ~``log(T)/log(chunk)``; no loop over time. Every power lies in
    [0, 1], so ``discount == 1`` and ``discount < 1`` are stable at any ``T`` (no overflow; powers
    that underflow to 0 are 0 to working precision).
    """
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {discount}; use gamma, lam in [0, 1]")
    if chunk < 2:
        raise ValueError(f"chunk must be >= 2, got {chunk}")
    if x.dim() != 2:
        raise ValueError(f"discounted_reverse_cumsum expects [N, T], got shape {tuple(x.shape)}")
    return _scan(x, float(discount), chunk)


def _scan(x: torch.Tensor, discount: float, chunk: int) -> torch.Tensor:
    num_rows, length = x.shape
    if length <= chunk:
        return x @ _power_matrix(discount, length, x)
    num_chunks = -(-length // chunk)
    pad = num_chunks * chunk - length
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x.contiguous()
    local = (xp.view(num_rows * num_chunks, chunk) @ _power_matrix(discount, chunk, x))
    local = local.view(num_rows, num_chunks, chunk)
    # True values at the chunk starts: s_i = local_i[0] + discount**chunk * s_{i+1}. That level is
    # 1/chunk the size, so it takes 4x longer chunks: fewer levels, less per-op overhead.
    starts = _scan(local[:, :, 0], discount**chunk, min(4 * chunk, _INNER_CHUNK))
    # y_i[j] = local_i[j] + discount**(chunk - j) * s_{i+1}, with s_{num_chunks} = 0
    next_starts = torch.nn.functional.pad(starts[:, 1:], (0, 1))
    carry_powers = _power_matrix(discount, chunk + 1, x)[chunk, :chunk]  # discount**(chunk - j)
    local.addcmul_(next_starts[:, :, None], carry_powers)
    return local.view(num_rows, num_chunks * chunk)[:, :length]


def _check_gae_inputs(rewards, values, action_mask, gamma, lam) -> None:
    if rewards.dim() != 2 or rewards.shape != values.shape or rewards.shape != action_mask.shape:
        raise ValueError(
            "gae expects rewards, values and action_mask of the same [B, T] shape, got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(action_mask.shape)}")
    for name, val in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= float(val) <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {val}")
    if rewards.shape[1] >= 1 << 24:  # action slots are counted with a float32 cumsum (exact below 2**24)
        raise ValueError(f"gae supports T < 2**24 tokens per row, got T={rewards.shape[1]}")


def _check_out(out, rewards: torch.Tensor, dtype: torch.dtype) -> None:
    if len(out) != 2:
        raise ValueError(f"gae out must be an (advantages, returns) pair, got {len(out)} tensors")
    for name, t in zip(("advantages", "returns"), out):
        if t.shape != rewards.shape or t.dtype != dtype or t.device != rewards.device or not t.is_contiguous():
            raise ValueError(
                f"gae out {name} must be a contiguous {tuple(rewards.shape)} {dtype} tensor on {rewards.device}, got "
                f"{tuple(t.shape)} {t.dtype} on {t.device}{'' if t.is_contiguous() else ' (not contiguous)'}")
    if out[0].data_ptr() == out[1].data_ptr() and out[0].numel():
        raise ValueError("gae out advantages and returns must be different tensors")


def _compact_block(rewards, values, maskf):
    """Fold and compact one block of rows ``[b, T]`` (mask as 0/1 floats in the compute dtype).

    Returns ``slot`` (``[b, T]`` int64: number of actions at or before t, so action ``a_k`` owns
    column k, 1-based), ``masked_values = V·mask``, ``u_c = r_c − V_c`` (``[b, W]``: folded rewards
    minus the action's value) and ``values_c`` (``[b, W + 1]``). ``scatter_add`` over ``slot`` folds
    every reward into the last action at or before it (module doc); column 0 collects the rewards
    before the first action (scratch, only ever read back at non-action tokens); columns past K stay
    0, which is the terminal value ``V[a_{K+1}] = 0``. W is a whole number of scan chunks.
    """
    slot_f = maskf.cumsum(1)  # float cumsum: ~8x faster than integer cumsum on CPU, exact below 2**24
    slot = slot_f.long()  # scatter/gather want int64 (int32 indices take a slow path on CPU)
    length = rewards.shape[1]
    # On CPU a host read is free, so the compacted scan runs over max(K) columns, not T.
    num_cols = int(slot_f[:, -1].max()) + 1 if rewards.device.type == "cpu" and length else length + 1
    width = -(-num_cols // _CHUNK) * _CHUNK
    masked_values = values * maskf
    u_c = rewards.new_zeros(rewards.shape[0], width).scatter_add_(1, slot, rewards - masked_values)
    values_c = rewards.new_zeros(rewards.shape[0], width + 1).scatter_add_(1, slot, masked_values)
    return slot, masked_values, u_c, values_c


def _gae_block(rewards, values, maskf, gamma: float, lam: float, skip_observations: bool, out):
    """GAE for one block of rows ``[b, T]`` into ``out = (advantages, returns)``."""
    slot, masked_values, u_c, values_c = _compact_block(rewards, values, maskf)
    if skip_observations:
        # δ_k = r[a_k] + γ V[a_{k+1}] − V[a_k] over compacted actions (docs/architecture.md#skip-observation-gae).
        delta = u_c.add_(values_c[:, 1:], alpha=gamma)
        adv = torch.gather(_scan(delta, gamma * lam, _CHUNK), 1, slot)
        torch.mul(adv, maskf, out=out[0])
        torch.add(out[0], masked_values, out=out[1])
        return
    # Plain: every position up to the last action token is a step; later positions end the episode.
    in_episode = (slot - maskf.to(slot.dtype) < slot[:, -1:]).to(maskf.dtype)  # an action at or after t
    step_rewards = torch.gather(u_c + values_c[:, :-1], 1, slot) * maskf
    step_values = values * in_episode
    next_values = torch.nn.functional.pad(step_values[:, 1:], (0, 1))
    delta = torch.add(step_rewards - step_values, next_values, alpha=gamma) * in_episode
    adv = _scan(delta, gamma * lam, _CHUNK)
    torch.mul(adv, maskf, out=out[0])
    # Returns at every step from the first action on (gae_value_mask); steps before it are the
    # prompt's positions (their rewards are dropped, and they are no state of the trajectory).
    adv.add_(values).mul_(in_episode * (slot > 0).to(maskf.dtype))
    out[1].copy_(adv)


@functools.cache
def _cpu_kernel():
    """The numba kernel module, or None when numba cannot be imported (then CPU tensors use the scan)."""
    try:
        from sao_megatron.algorithms import gae_cpu  # numba: imported on first CPU use, not with the package
    except ImportError as exc:
        logger.warning("GAE on CPU tensors uses the vectorised scan: the numba kernel is unavailable (%s)", exc)
        return None
    return gae_cpu


def gae_impl_for(rewards: torch.Tensor) -> str:
    """What ``gae(impl="auto")`` runs for tensors on this device: ``"kernel"`` or ``"scan"``."""
    return "kernel" if rewards.device.type == "cpu" and _cpu_kernel() is not None else "scan"


@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor, *, gamma: float, lam: float,
        skip_observations: bool = True, impl: str = "auto",
        out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE; skip-observation by default (docs/architecture.md#skip-observation-gae).

    rewards, values: ``[B, T]`` floating (values aligned like log-probs: ``V[t]`` is the state in which
    ``y_t`` is chosen); action_mask: ``[B, T]`` bool or 0/1. Any padding side works. All entries,
    padding included, must be finite: masking is done by multiplying with the 0/1 mask (fast on CPU).
    Returns ``(advantages, returns)``, ``[B, T]`` in ``promote(rewards, values, float32)``: advantages
    0 where ``action_mask == 0``, returns 0 outside ``gae_value_mask(action_mask, skip_observations)``
    (the critic's training targets). Targets only: computed without autograd.

    ``skip_observations=True``: over the action positions ``a_1 < … < a_K`` of each row,
    ``δ_k = r[a_k] + γ V[a_{k+1}] − V[a_k]`` (``V[a_{K+1}] = 0``), ``Â_k = δ_k + γλ Â_{k+1}``,
    ``G_k = Â_k + V[a_k]``; values at observation tokens only enter multiplied by 0.
    ``skip_observations=False``: plain token-level GAE where every position up to the row's last
    action token is a step (observation tokens: reward 0 after folding, their own values); the
    observation tokens between the first and last action get returns ``G_t = Â_t + V[t]`` too
    (standard token-level GAE trains the critic on every step), advantages still only on actions.

    ``impl``: ``"kernel"`` is the fused single-pass numba kernel (CPU tensors only, ``gae_cpu``);
    ``"scan"`` the vectorised compaction + blocked scan in PyTorch (any device); ``"auto"`` picks
    the kernel on CPU (the scan where numba cannot be imported) and the scan elsewhere. Both compute
    the same recursion (tested against the same references); benchmarks/advantages.py times them.
    """
    _check_gae_inputs(rewards, values, action_mask, gamma, lam)
    if impl not in GAE_IMPLS:
        raise ValueError(f"gae impl must be one of {GAE_IMPLS}, got {impl!r}")
    on_cpu = rewards.device.type == "cpu"
    if impl == "kernel" and not on_cpu:
        raise ValueError(f"gae impl='kernel' runs on CPU tensors only, got {rewards.device}; use impl='auto' or 'scan'")
    dtype = torch.promote_types(torch.promote_types(rewards.dtype, values.dtype), torch.float32)
    mask = action_mask if action_mask.dtype == torch.bool else action_mask != 0
    if out is not None:
        _check_out(out, rewards, dtype)
    if impl == "kernel" and _cpu_kernel() is None:
        raise ValueError("gae impl='kernel' needs numba, which cannot be imported here; use impl='auto' or 'scan'")
    if impl == "kernel" or (impl == "auto" and gae_impl_for(rewards) == "kernel"):
        return _cpu_kernel().gae_rows(
            rewards.detach().to(dtype).contiguous(), values.detach().to(dtype).contiguous(), mask.contiguous(),
            gamma=float(gamma), lam=float(lam), skip_observations=skip_observations,
            num_threads=torch.get_num_threads(), out=out)
    # Float 0/1 mask: multiplying by it is ~10x faster on CPU than torch.where on a bool mask.
    maskf = mask.view(torch.uint8).to(dtype)
    advantages, returns = out or (torch.empty(rewards.shape, dtype=dtype, device=rewards.device) for _ in range(2))
    num_rows, length = rewards.shape
    # On CPU, blocks of rows keep the temporaries cache-resident; on accelerators one block.
    block = num_rows if rewards.device.type != "cpu" else max(1, _CPU_BLOCK_ELEMENTS // max(length, 1))
    for lo in range(0, num_rows, block):
        rows = slice(lo, lo + block)
        _gae_block(rewards[rows].to(dtype), values[rows].to(dtype), maskf[rows], float(gamma), float(lam),
                   skip_observations, (advantages[rows], returns[rows]))
    return advantages, returns


def gae_value_mask(action_mask: torch.Tensor, *, skip_observations: bool) -> torch.Tensor:
    """Where ``gae`` gives returns (the critic's value-loss tokens): ``[B, T]`` bool.

    Skip-observation GAE: the action tokens. Plain token GAE: every position from a row's first to
    its last action token (the observation tokens between turns are steps of their own); positions
    before the first action (the prompt) and after the last are not steps.
    """
    mask = action_mask if action_mask.dtype == torch.bool else action_mask != 0
    if skip_observations:
        return mask.clone()
    seen = mask.cumsum(1)  # actions at or before t
    return (seen > 0) & (seen - mask.long() < seen[:, -1:])  # an action at or before t, and one at or after t


def broadcast_outcome_advantages(outcome_advantages: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Per-sample advantages ``[B]`` to every action token: ``[B, T]``, 0 off the action mask."""
    mask = action_mask if action_mask.dtype == torch.bool else action_mask != 0
    return torch.where(mask, outcome_advantages[:, None], 0.0).to(outcome_advantages.dtype)


def grpo_advantages(outcome_rewards: torch.Tensor, group_ids: torch.Tensor, *, eps: float = 1e-6,
                    normalize_std: bool = True) -> torch.Tensor:
    """Group-normalised outcome advantages (GRPO, DeepSeekMath §4.1.2): ``(R - mean_g) / (std_g + eps)``.

    outcome_rewards: ``[N]`` floating; group_ids: ``[N]`` integer, any values (samples with the same
    id form a group, in any order). ``std_g`` is the unbiased (Bessel) std, as in verl and TRL.
    A group of one has ``R - mean_g = 0`` and gets advantage 0: a lone rollout carries no
    group baseline (the paper's point about single rollouts). Returns ``[N]``.
    """
    if outcome_rewards.dim() != 1 or outcome_rewards.shape != group_ids.shape:
        raise ValueError("grpo_advantages expects outcome_rewards and group_ids of the same [N] shape, got "
                         f"{tuple(outcome_rewards.shape)} and {tuple(group_ids.shape)}")
    rewards = outcome_rewards.to(torch.promote_types(outcome_rewards.dtype, torch.float32))
    _, group, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    counts = counts.to(rewards.dtype)
    sums = rewards.new_zeros(counts.shape).index_add_(0, group, rewards)
    centred = rewards - (sums / counts)[group]
    if not normalize_std:
        return centred
    squares = rewards.new_zeros(counts.shape).index_add_(0, group, centred * centred)
    std = (squares / (counts - 1).clamp(min=1)).sqrt()
    return centred / (std[group] + eps)


def running_mean_advantages(outcome_rewards: torch.Tensor, group_ids: torch.Tensor | None = None, *,
                            baseline: RunningMeanBaseline) -> torch.Tensor:
    """``[N] -> [N]``: rewards minus ``baseline`` as it stood before this batch, then the batch folded
    into it (the paper's running-mean ablation). ``group_ids`` is not read: the signature is that of
    ``grpo_advantages``, so the objectives table calls either the same way."""
    out = baseline.advantages(outcome_rewards)
    baseline.update(outcome_rewards)
    return out


class RunningMeanBaseline:
    """Running-mean reward baseline, the paper's ablation in place of the critic.

    ``advantages(R)`` returns ``R - b`` with the baseline *before* this batch (so ``b`` does not depend
    on the samples it centres), then ``update(R)`` folds the batch in. ``momentum=None``: ``b`` is the
    exact mean of every reward seen; otherwise ``b ← momentum·b + (1 − momentum)·mean(R)``, the
    first batch initialising ``b`` to its mean. Checkpoint with ``state_dict``/``load_state_dict``.
    """

    def __init__(self, *, momentum: float | None = 0.99, initial: float = 0.0):
        if momentum is not None and not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1) or None (exact running mean), got {momentum}")
        self.momentum = momentum
        self.value = float(initial)
        self.count = 0

    def advantages(self, outcome_rewards: torch.Tensor) -> torch.Tensor:
        """``[N] -> [N]``: rewards minus the current baseline."""
        return outcome_rewards.to(torch.promote_types(outcome_rewards.dtype, torch.float32)) - self.value

    def update(self, outcome_rewards: torch.Tensor) -> None:
        """Fold a batch of outcome rewards ``[N]`` into the baseline (one host sync)."""
        num = outcome_rewards.numel()
        if num == 0:
            return
        batch_mean = outcome_rewards.detach().double().mean().item()
        if not math.isfinite(batch_mean):
            raise ValueError(f"running-mean baseline got a non-finite reward mean {batch_mean}; check the reward function")
        if self.momentum is None:
            self.value += (batch_mean - self.value) * num / (self.count + num)
        elif self.count == 0:
            self.value = batch_mean
        else:
            self.value = self.momentum * self.value + (1.0 - self.momentum) * batch_mean
        self.count += num

    def state_dict(self) -> dict:
        return {"value": self.value, "count": self.count, "momentum": self.momentum}

    def load_state_dict(self, state: dict) -> None:
        if state.get("momentum") != self.momentum:
            raise ValueError(f"running-mean baseline checkpoint has momentum {state.get('momentum')}, "
                             f"this run uses {self.momentum}; set algorithm.running_mean.momentum to match")
        self.value, self.count = float(state["value"]), int(state["count"])


def running_mean_baseline(*, momentum: float | None = 0.99, initial: float = 0.0) -> RunningMeanBaseline:
    """Build the running-mean baseline (see ``RunningMeanBaseline``)."""
    return RunningMeanBaseline(momentum=momentum, initial=initial)
