"""The sample record handed from the scheduler to the trainer, and its collation to tensors.

A sample is one prompt and one trajectory ``y_0..y_{T-1}`` (everything after the prompt: the
policy's action tokens and the environment's observation tokens, in order). Per trajectory token:

- ``action_mask[t]``: 1 if the policy generated it, 0 if the environment inserted it;
- ``rollout_logprobs[t]``: the engine's log-prob when it generated the token (0.0 where mask 0);
- ``versions[t]``: the weight version that generated it (the engine's per-token version, so a
  partial rollout continued across a weight update carries several); observation tokens carry -1
  (they come from the environment, not from any policy version, and never count for staleness).

Rewards: a scalar outcome ``reward`` goes on the last action token; per-turn rewards
(``turn_rewards[i]``) on the last action token of turn ``i`` (``token_rewards()``).
Turns: ``turn_spans[i] = [start, end)`` of turn ``i``'s action tokens in trajectory positions; the
observation of turn ``i`` (if any) fills ``[end_i, start_{i+1})``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np


@dataclass(slots=True)
class Sample:
    """One finished episode (see module docstring for the per-token conventions)."""

    prompt_ids: list[int]
    response_ids: list[int]
    action_mask: list[int]
    rollout_logprobs: list[float]
    versions: list[int]
    reward: float = 0.0
    """Scalar outcome reward (0.0 with ``reward_error`` set when the reward function failed)."""
    turn_rewards: list[float] = field(default_factory=list)
    turn_spans: list[list[int]] = field(default_factory=list)
    index: int = -1
    """Dataset index of the prompt."""
    epoch: int = 0
    """Pass over the dataset the prompt was drawn in ((epoch, index) is unique per trained sample)."""
    group_id: int = -1
    """Id shared by the G samples of one prompt in group mode (unique per sample in single mode)."""
    attempt: int = 1
    """How many times this prompt was started (re-queued prompts count up)."""
    finish_reason: str = "stop"
    """Last turn's engine finish reason (stop/length), or max_turns/max_total_tokens."""
    phase: int = 0
    """Reward-schedule phase the outcome reward was computed under."""
    reward_info: dict[str, float] = field(default_factory=dict)
    reward_error: str | None = None
    num_interruptions: int = 0
    """Weight updates this episode's generation was paused by."""
    timings: dict[str, float] = field(default_factory=dict)
    """Wall-clock stamps (unix s: start, end) and durations (s: generate, env, reward, queue)."""
    routed_experts: np.ndarray | None = None
    """int32 [prompt+trajectory-1, num_layers, topk] from the episode's last request, if requested."""

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if not len(self.action_mask) == len(self.rollout_logprobs) == len(self.versions) == n:
            raise ValueError(f"per-token fields disagree in length: response {n}, mask {len(self.action_mask)}, "
                             f"logprobs {len(self.rollout_logprobs)}, versions {len(self.versions)}")

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    @property
    def action_versions(self) -> list[int]:
        return [v for v, m in zip(self.versions, self.action_mask) if m]

    def oldest_version(self) -> int | None:
        """Oldest weight version among the action tokens (None without action tokens)."""
        vs = self.action_versions
        return min(vs) if vs else None

    def staleness(self, version: int) -> int:
        """``version`` minus the oldest action-token version (0 without action tokens)."""
        oldest = self.oldest_version()
        return 0 if oldest is None else version - oldest

    def token_rewards(self) -> list[float]:
        """Per trajectory token: per-turn rewards and the outcome on the right action tokens."""
        out = [0.0] * len(self.response_ids)
        for (start, end), r in zip(self.turn_spans, self.turn_rewards):
            if end > start:
                out[end - 1] += r
        actions = [t for t, m in enumerate(self.action_mask) if m]
        if actions:
            out[actions[-1]] += self.reward
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (checkpoints, inspection)."""
        d = asdict(self)
        if self.routed_experts is not None:
            d["routed_experts"] = {"shape": list(self.routed_experts.shape),
                                   "data": self.routed_experts.astype(np.int32).ravel().tolist()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown Sample fields {sorted(unknown)}")
        d = dict(d)
        re = d.get("routed_experts")
        if re is not None:
            d["routed_experts"] = np.asarray(re["data"], dtype=np.int32).reshape(re["shape"])
        return cls(**d)


def collate(samples: list[Sample], *, pad_id: int = 0, pad_to_multiple: int = 1) -> dict[str, Any]:
    """Right-padded tensors [B, L] over the full sequences (prompt + trajectory).

    Trajectory position t of sample b sits at full position ``prompt_lens[b] + t``; every per-token
    field is zero (``versions``: -1) at prompt and padding positions. The log-prob of token
    ``tokens[b, i]`` comes from the logits at position ``i - 1``.

    Returns: tokens, attention_mask, action_mask (int64 [B, L]); rollout_logprobs, token_rewards
    (float32 [B, L]); versions (int64 [B, L]); prompt_lens, seq_lens, index, epoch, group_id
    (int64 [B]); rewards (float32 [B]).
    """
    import torch

    if not samples:
        raise ValueError("collate needs at least one sample")
    lens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    width = -(-max(lens) // pad_to_multiple) * pad_to_multiple
    b = len(samples)
    tokens = np.full((b, width), pad_id, dtype=np.int64)
    attn, action = np.zeros((b, width), np.int64), np.zeros((b, width), np.int64)
    logp, rew = np.zeros((b, width), np.float32), np.zeros((b, width), np.float32)
    vers = np.full((b, width), -1, dtype=np.int64)
    for i, s in enumerate(samples):
        p, n = len(s.prompt_ids), lens[i]
        tokens[i, :n] = s.prompt_ids + s.response_ids
        attn[i, :n] = 1
        action[i, p:n] = s.action_mask
        logp[i, p:n] = s.rollout_logprobs
        vers[i, p:n] = s.versions
        rew[i, p:n] = s.token_rewards()
    out = {"tokens": tokens, "attention_mask": attn, "action_mask": action, "rollout_logprobs": logp,
           "versions": vers, "token_rewards": rew}
    per_sample = {"prompt_lens": [len(s.prompt_ids) for s in samples], "seq_lens": lens,
                  "index": [s.index for s in samples], "epoch": [s.epoch for s in samples],
                  "group_id": [s.group_id for s in samples]}
    result = {k: torch.from_numpy(v) for k, v in out.items()}
    result.update({k: torch.tensor(v, dtype=torch.int64) for k, v in per_sample.items()})
    result["rewards"] = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    return result


def demonstration_sample(prompt_ids: list[int], response_ids: list[int], action_mask: list[int], *,
                         index: int = -1) -> Sample:
    """A sample for supervised warm-up from a task demonstration (log-probs 0, version -1)."""
    return Sample(prompt_ids=list(prompt_ids), response_ids=list(response_ids), action_mask=list(action_mask),
                  rollout_logprobs=[0.0] * len(response_ids), versions=[-1] * len(response_ids), index=index)
