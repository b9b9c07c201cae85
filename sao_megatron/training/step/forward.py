"""Forward/backward over a list of micro-batches with Megatron's schedules (PP = 1, 1F1B, interleaved).

Micro-batch format: a mapping with ``tokens`` [b, s] (right-padded), optional
``position_ids`` [b, s] (default 0..s-1) and any per-task tensors the loss
needs. Attention is causal only: with right padding, real tokens never attend
to padding, so no padding mask is needed. Shapes may differ between
micro-batches (padded to a common shape where the pipeline schedule needs one).

Loss convention: ``loss_fn(output, microbatch) -> (loss, metrics)`` returns this
micro-batch's share of the global objective, already normalised by global
counts (e.g. the number of action tokens in the whole batch, all DP ranks).
Megatron is configured (``calculate_per_token_loss``) not to rescale it:
gradients are summed over micro-batches and data-parallel ranks.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.utils import get_model_config

from sao_megatron.models.actor import token_logprobs
from sao_megatron.models.critic import token_values
from sao_megatron.models.routing_replay import replaying

if TYPE_CHECKING:
    from sao_megatron.parallel.bootstrap import ParallelContext

MicroBatchLike = Mapping[str, torch.Tensor]
"""Any mapping of tensors with ``tokens``: the RL step's typed ``batch.MicroBatch``, or a plain dict."""
LossFn = Callable[[torch.Tensor, MicroBatchLike], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """[1, 1, s, s] bool, True where attention is NOT allowed (Megatron's convention)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def position_ids_of(mb: MicroBatchLike) -> torch.Tensor:
    tokens = mb["tokens"]
    if "position_ids" in mb:
        return mb["position_ids"]
    return torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)


def check_microbatches(microbatches: Sequence[MicroBatchLike], ctx: ParallelContext, config) -> None:
    """ValueError with the fix when the micro-batches cannot run on this layout."""
    shapes = {tuple(mb["tokens"].shape) for mb in microbatches}
    for shape in shapes:
        if len(shape) != 2:
            raise ValueError(f"micro-batch tokens must be [b, s], got {list(shape)}")
        if config.sequence_parallel and shape[1] % ctx.tp_size:
            raise ValueError(f"sequence length {shape[1]} is not a multiple of TP={ctx.tp_size} (sequence "
                             f"parallel): pad micro-batches to a multiple of {ctx.tp_size}")
    if ctx.vpp_size and ctx.pp_size > 1 and len(microbatches) % ctx.pp_size:
        raise ValueError(f"interleaved pipeline needs a number of micro-batches divisible by PP={ctx.pp_size}, "
                         f"got {len(microbatches)}")


def forward_backward(model_chunks: Sequence[torch.nn.Module], microbatches: Sequence[MicroBatchLike], loss_fn: LossFn,
                     *, ctx: ParallelContext, forward_only: bool = False) -> list[dict[str, torch.Tensor]]:
    """Run every micro-batch through the model chunks (and backward unless ``forward_only``).

    Returns the metrics dict of ``loss_fn`` per micro-batch on the last pipeline stage, [] elsewhere.
    Gradients accumulate into the DDP grad buffers (zero them before; the optimizer step after).
    """
    if not microbatches:
        return []
    config = get_model_config(model_chunks[0])
    check_microbatches(microbatches, ctx, config)
    # Megatron's local attention builds its default causal mask on "cuda": pass one explicitly.
    use_mask = not _uses_te(model_chunks[0])
    max_b = max(mb["tokens"].shape[0] for mb in microbatches)
    max_s = max(mb["tokens"].shape[1] for mb in microbatches)
    # Pipeline stages exchange activation shapes only with variable_seq_lengths (off for interleaved
    # PP, where Megatron's shape exchange deadlocks on gloo, and for the allgather dispatcher): then
    # every micro-batch is padded to one [max_b, max_s] shape and outputs are cut back for loss_fn.
    fixed = ctx.pp_size > 1 and not config.variable_seq_lengths
    inputs = [_pad_inputs(mb, max_b, max_s) if fixed else _inputs(mb) for mb in microbatches]

    def forward_step(data_iterator, model):
        (tokens, position_ids), mb = next(data_iterator)
        mask = causal_mask(tokens.shape[1], tokens.device) if use_mask else None
        with replaying(model, mb, tokens.shape):  # routing replay: this micro-batch's engine routes, if any
            output = model(tokens, position_ids, mask)
        return output, functools.partial(_megatron_loss, loss_fn, mb)

    kwargs = dict(
        forward_step_func=forward_step, model=list(model_chunks), num_microbatches=len(microbatches),
        data_iterator=[iter(list(zip(inputs, microbatches))) for _ in model_chunks],
        seq_length=max_s, micro_batch_size=max_b, forward_only=forward_only, pg_collection=ctx.pg)
    if ctx.pp_size > 1:
        kwargs["p2p_communicator"] = P2PCommunicator(pp_group=ctx.pp_group, config=config)
    schedule = get_forward_backward_func(pp_size=ctx.pp_size, vp_size=ctx.vpp_size if ctx.pp_size > 1 else None)
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        return list(schedule(**kwargs))


def _uses_te(chunk: torch.nn.Module) -> bool:
    return any(type(m).__module__.startswith("megatron.core.extensions.transformer_engine") for m in chunk.modules())


def _inputs(mb: MicroBatchLike) -> tuple[torch.Tensor, torch.Tensor]:
    return mb["tokens"], position_ids_of(mb)


def _pad_inputs(mb: MicroBatchLike, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right/bottom-pad tokens with 0 (causal attention: real tokens never see the padding)."""
    tokens, positions = _inputs(mb)
    b, s = tokens.shape
    tokens = torch.nn.functional.pad(tokens, (0, cols - s, 0, rows - b))
    extra = torch.arange(s, cols, device=positions.device).expand(b, -1)
    positions = torch.nn.functional.pad(torch.cat([positions, extra], dim=1), (0, 0, 0, rows - b))
    return tokens, positions


def _megatron_loss(loss_fn: LossFn, mb: MicroBatchLike, output: torch.Tensor):
    b, s = mb["tokens"].shape
    loss, metrics = loss_fn(output[:b, :s], mb)  # drop the padding of fixed-shape pipelines
    # The 3-tuple form with calculate_per_token_loss=True: Megatron leaves the loss unscaled.
    return loss, torch.ones((), dtype=torch.int), metrics


def _forward_only_tensors(model_chunks, microbatches, ctx: ParallelContext,
                          per_token: Callable[[torch.Tensor, MicroBatchLike], torch.Tensor], *,
                          broadcast: bool) -> list[torch.Tensor]:
    """Run forward only, collect one [b, s] fp32 tensor per micro-batch, optionally broadcast over PP."""
    def loss_fn(output, mb):
        return output.new_zeros(()), {"out": per_token(output, mb).detach()}

    was_training = [c.training for c in model_chunks]
    for c in model_chunks:
        c.eval()
    try:
        results = [r["out"] for r in forward_backward(model_chunks, microbatches, loss_fn, ctx=ctx,
                                                      forward_only=True)]
    finally:
        for c, mode in zip(model_chunks, was_training):
            c.train(mode)
    if broadcast and ctx.pp_size > 1:
        results = _broadcast_from_last_stage(results, microbatches, ctx)
    return results


def _broadcast_from_last_stage(results, microbatches, ctx: ParallelContext) -> list[torch.Tensor]:
    src = dist.get_global_rank(ctx.pp_group, ctx.pp_size - 1)
    out = []
    for i, mb in enumerate(microbatches):
        t = results[i] if ctx.is_last_stage else torch.empty(mb["tokens"].shape, dtype=torch.float32,
                                                               device=mb["tokens"].device)
        dist.broadcast(t, src=src, group=ctx.pp_group)
        out.append(t)
    return out


def compute_logprobs(actor_chunks: Sequence[torch.nn.Module], microbatches: Sequence[MicroBatchLike], *,
                     ctx: ParallelContext, vocab_size: int, temperature: float = 1.0,
                     broadcast: bool = True) -> list[torch.Tensor]:
    """Per-token log-probs [b, s] per micro-batch (column 0 = 0), no gradient.

    Available on the last pipeline stage; on every stage when ``broadcast``.
    """
    def per_token(logits, mb):
        lp, _ = token_logprobs(logits, mb["tokens"], tp_group=ctx.tp_group, vocab_size=vocab_size,
                               temperature=temperature, with_entropy=False)
        return lp

    return _forward_only_tensors(actor_chunks, microbatches, ctx, per_token, broadcast=broadcast)


def compute_values(critic_chunks: Sequence[torch.nn.Module], microbatches: Sequence[MicroBatchLike], *,
                   ctx: ParallelContext, broadcast: bool = True) -> list[torch.Tensor]:
    """Per-token values [b, s] per micro-batch, aligned like log-probs (column 0 = 0), no gradient."""
    return _forward_only_tensors(critic_chunks, microbatches, ctx, lambda v, mb: token_values(v),
                                 broadcast=broadcast)
