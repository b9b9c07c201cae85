"""Batch preparation: samples -> this rank's micro-batches on the model's device (one function).

The RL update, value pretraining and the supervised warm-up all train on batches
made here. Every tensor a model or a collective sees is created on (or moved to)
``device`` (the trainer's ``ctx.device``): CUDA weights next to CPU batches fail at
the first forward, and NCCL has no CPU path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from sao_megatron.errors import SaoError
from sao_megatron.scheduler.sample import Sample, collate
from sao_megatron.training.step.microbatch import plan_microbatches, slice_padded

PER_TOKEN_KEYS = ("tokens", "action_mask", "rollout_logprobs", "token_rewards", "versions")
ROUTE_KEYS = ("routed_experts", "route_valid")  # [b, s, num_layers * topk] and [b, s] (models.routing_replay)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class MicroBatch(Mapping[str, torch.Tensor]):
    """One micro-batch of this rank's rows on the device: ``b`` rows right-padded to ``s`` positions.

    Built once by :func:`prepare_batch` (the inputs); never changed. What the RL step computes from it
    is added by making a new micro-batch (:meth:`with_`), in this order: ``rl_step.attach_advantages``
    (advantages; with a critic also returns, old_values, value_mask), then inside ``rl_step.actor_update``
    old_logprobs (objectives whose ratio is against the policy before the step). It reads as a
    ``Mapping`` of its set fields (``mb["tokens"]``): the forward schedule and routing replay take any
    mapping of tensors, and an objective names its behaviour log-probs by key (``ratio_against``).
    """

    tokens: torch.Tensor
    """[b, s] int64 token ids (prompt + response), padded after each row's end."""
    action_mask: torch.Tensor
    """[b, s] float32: 1 at tokens the policy sampled (the ones trained on)."""
    rollout_logprobs: torch.Tensor
    """[b, s] float32: the engines' log-probs of the sampled tokens (0 elsewhere)."""
    token_rewards: torch.Tensor
    """[b, s] float32: reward credited per token (the outcome reward at the last action token)."""
    versions: torch.Tensor
    """[b, s] int64: policy version that sampled each response token (-1 elsewhere)."""
    row: torch.Tensor
    """[b] int64: index of each row in the global batch (``LocalBatch.full``)."""
    routed_experts: torch.Tensor | None = None
    """[b, s, num_layers * topk] int: the engine's routed experts (routing replay only)."""
    route_valid: torch.Tensor | None = None
    """[b, s] bool: positions whose routes the engine returned (routing replay only)."""
    advantages: torch.Tensor | None = None
    """[b, s] float32, 0 off action tokens (``rl_step.attach_advantages``)."""
    returns: torch.Tensor | None = None
    """[b, s] float32 GAE returns, the critic's targets (with a critic)."""
    old_values: torch.Tensor | None = None
    """[b, s] float32 critic values before its update, 0 off ``value_mask`` (with a critic)."""
    value_mask: torch.Tensor | None = None
    """[b, s] float32: tokens the value loss covers (with a critic)."""
    old_logprobs: torch.Tensor | None = None
    """[b, s] float32 log-probs of the actor before the batch's first step (objectives that need them)."""

    def with_(self, **computed: torch.Tensor) -> MicroBatch:
        """A new micro-batch with ``computed`` fields set (this one unchanged)."""
        return dataclasses.replace(self, **computed)

    def __getitem__(self, key: str) -> torch.Tensor:
        value = getattr(self, key, None) if key in _FIELDS else None
        if value is None:
            raise KeyError(key)
        return value

    def __iter__(self) -> Iterator[str]:
        return (name for name in _FIELDS if getattr(self, name) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


_FIELDS = tuple(f.name for f in dataclasses.fields(MicroBatch))


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalBatch:
    """This rank's micro-batches plus the global counts that normalise every loss. Never changed: the
    RL step's advantages make a new batch (``rl_step.attach_advantages``)."""

    microbatches: list[MicroBatch]
    """This rank's micro-batches on the device, in training order."""
    full: dict[str, Any]
    """The collated global batch on the host (``scheduler.sample.collate``): rewards, group ids, lengths."""
    num_tokens: int
    """Action tokens in the whole global batch (all DP ranks)."""
    num_sequences: int
    """Samples in the whole global batch."""
    device: torch.device
    """Where the micro-batches live (the models' device)."""
    outcome_advantages: torch.Tensor | None = None
    """Per-sample advantages [B_global] on ``device`` for outcome-only objectives (grpo*, running mean)."""
    value_mask: torch.Tensor | None = None
    """[B_global, L] float32 on the host: every token the value loss covers (its sum normalises it);
    set with the critic's advantages."""


def check_token_ids(tokens: torch.Tensor, vocab_size: int) -> None:
    """Every token id of a batch is a real vocabulary entry (the engines sample from the same model).

    An id outside ``[0, vocab_size)`` means the engines serve a different model or tokenizer than
    ``model.vocab_size`` describes; its log-prob would be -inf, so stop before training on it.
    """
    if tokens.numel() == 0:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        bad = high if high >= vocab_size else low
        raise SaoError(f"a rollout holds token id {bad}, outside model.vocab_size={vocab_size}: the engines serve "
                       "a model or tokenizer other than the configured one; point them at the trainer's weights "
                       "(model.hf_dir) or set model.vocab_size to the checkpoint's vocabulary")


def prepare_batch(samples: list[Sample], *, dp_rank: int, dp_size: int, pad_multiple: int, max_tokens: int,
                  vocab_size: int, device: torch.device | str, min_microbatches: int = 1) -> LocalBatch:
    """Collate the global batch, check its token ids, and give this DP rank its micro-batches.

    Rows are dealt round-robin over length-sorted samples (balanced DP shards), then packed into
    micro-batches of at most ``max_tokens`` padded tokens (``training.step.microbatch``), sequence
    lengths padded to ``pad_multiple`` (the TP size, for sequence parallelism). ``min_microbatches``:
    split micro-batches until there are at least this many (one per mini-batch of a PPO-style update).
    """
    full = collate(samples, pad_to_multiple=pad_multiple)
    check_token_ids(full["tokens"], vocab_size)
    seq_lens = full["seq_lens"].tolist()
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    mine = order[dp_rank::dp_size]
    tensors = {k: full[k] for k in PER_TOKEN_KEYS}
    tensors["action_mask"] = tensors["action_mask"].float()
    tensors |= {k: full[k] for k in ROUTE_KEYS if k in full}  # routing replay: engine routes per position
    plan = plan_microbatches([seq_lens[i] for i in mine], max_tokens=max_tokens, pad_multiple=pad_multiple,
                             num_microbatches_multiple=min_microbatches)
    if len(plan.indices) < min_microbatches:
        raise SaoError(f"data-parallel rank {dp_rank} holds {len(mine)} samples, fewer than the "
                       f"{min_microbatches} mini-batches asked for: lower actor.num_minibatches or raise "
                       "scheduler.batch_size")
    device = torch.device(device)
    mbs = []
    for group, seq in zip(plan.indices, plan.seq_lengths):
        rows = [mine[j] for j in group]
        fields = {k: v.to(device, non_blocking=True) for k, v in slice_padded(tensors, rows, seq).items()}
        mbs.append(MicroBatch(**fields, row=torch.tensor(rows, dtype=torch.long, device=device)))
    return LocalBatch(microbatches=mbs, full=full, num_tokens=int(full["action_mask"].sum()),
                      num_sequences=len(seq_lens), device=device)


def prepare_local_batch(samples: list[Sample], ctx, *, max_tokens: int, vocab_size: int,
                        min_microbatches: int = 1) -> LocalBatch:
    """:func:`prepare_batch` for this rank of ``ctx`` (a ``ParallelContext``): its DP shard, sequences
    padded to a multiple of the TP size, on ``ctx.device``."""
    return prepare_batch(samples, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size, pad_multiple=ctx.tp_size,
                         max_tokens=max_tokens, vocab_size=vocab_size, device=ctx.device,
                         min_microbatches=min_microbatches)


def minibatch_groups(batch: LocalBatch, num_minibatches: int) -> list[list[int]]:
    """Micro-batch indices of each mini-batch: contiguous, as even as the micro-batches allow."""
    n = len(batch.microbatches)
    bounds = [round(k * n / num_minibatches) for k in range(num_minibatches + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(num_minibatches)]
