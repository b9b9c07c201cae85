"""Slow, obviously-correct reference implementations for the algorithms unit tests.

Plain Python loops over Python floats, one row and one token at a time, written straight from
docs/architecture.md#the-algorithm and sharing no code with sao_megatron.algorithms.
"""

from __future__ import annotations

import math
import random

import torch


def reverse_scan(xs: list[float], discount: float) -> list[float]:
    """y_t = x_t + discount * y_{t+1}."""
    out, acc = [0.0] * len(xs), 0.0
    for t in reversed(range(len(xs))):
        acc = xs[t] + discount * acc
        out[t] = acc
    return out


def fold_rewards(rewards: list[float], mask: list[bool]) -> list[float]:
    """Move every reward onto the last action token at or before it; drop rewards before the first action."""
    folded, last_action = [0.0] * len(rewards), None
    for t, (r, m) in enumerate(zip(rewards, mask)):
        if m:
            last_action = t
        if last_action is not None:
            folded[last_action] += r
    return folded


def gae_row(rewards: list[float], values: list[float], mask: list[bool], gamma: float, lam: float,
            skip_observations: bool) -> tuple[list[float], list[float]]:
    """Skip-observation GAE by explicit compaction, or plain token GAE up to the last action.

    Advantages on action tokens only; returns on every step from the first action on (plain: the
    observation tokens between turns are steps, and the critic learns their values too)."""
    length = len(rewards)
    adv, ret = [0.0] * length, [0.0] * length
    actions = [t for t in range(length) if mask[t]]
    if not actions:
        return adv, ret
    folded = fold_rewards(rewards, mask)
    steps = actions if skip_observations else list(range(actions[-1] + 1))
    next_value, running = 0.0, 0.0
    for t in reversed(steps):
        delta = folded[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        next_value = values[t]
        if mask[t]:
            adv[t] = running
        if t >= actions[0]:
            ret[t] = running + values[t]
    return adv, ret


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float,
        skip_observations: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [gae_row(r, v, [bool(x) for x in m], gamma, lam, skip_observations)
            for r, v, m in zip(rewards.double().tolist(), values.double().tolist(), mask.tolist())]
    adv = torch.tensor([a for a, _ in rows], dtype=torch.float64).reshape(rewards.shape)
    ret = torch.tensor([g for _, g in rows], dtype=torch.float64).reshape(rewards.shape)
    return adv, ret


def value_mask_row(mask: list[bool], skip_observations: bool) -> list[bool]:
    """Where a row has returns: its actions, or (plain) every position from its first to its last action."""
    actions = [t for t, m in enumerate(mask) if m]
    if skip_observations or not actions:
        return list(mask)
    return [actions[0] <= t <= actions[-1] for t in range(len(mask))]


def multi_turn_mask(rng: random.Random, batch: int, length: int, *, min_run: int = 1, max_run: int = 6) -> torch.Tensor:
    """Rows of alternating observation / action runs, each row ending in right padding."""
    rows = []
    for _ in range(batch):
        end, row, acting = rng.randint(0, length), [], rng.random() < 0.5
        while len(row) < end:
            row += [acting] * rng.randint(min_run, max_run)
            acting = not acting
        rows.append((row[:end] + [False] * length)[:length])
    return torch.tensor(rows, dtype=torch.bool)


def dis_token(logp: float, rollout_logp: float, adv: float, eps_low: float, eps_high: float) -> tuple[float, float]:
    """(per-token loss numerator, d numerator / d logp) for one action token."""
    ratio = math.exp(logp - rollout_logp)
    if 1.0 - eps_low <= ratio <= 1.0 + eps_high:
        return -ratio * adv, -ratio * adv
    return 0.0, 0.0


def ppo_token(logp: float, old_logp: float, adv: float, clip_low: float, clip_high: float,
              dual_clip: float | None) -> tuple[float, float, bool]:
    """(per-token loss, d loss / d logp, clipped?) for one action token."""
    ratio = math.exp(logp - old_logp)
    unclipped, clipped = -adv * ratio, -adv * min(max(ratio, 1.0 - clip_low), 1.0 + clip_high)
    loss, grad = (unclipped, -adv * ratio) if unclipped >= clipped else (clipped, 0.0)
    if dual_clip is not None and adv < 0 and loss > -dual_clip * adv:
        loss, grad = -dual_clip * adv, 0.0
    return loss, grad, clipped > unclipped
