"""Actor: per-token log-probs and entropy from vocab-parallel logits.

With tensor parallelism each rank holds logits for a contiguous slice of the
(padded) vocabulary. The log-softmax is computed without gathering the full
vocabulary: per-row max, sum of exponentials, target logit and expected logit
are reduced over the TP group in forward; backward needs no communication (each
rank writes its own slice's gradient from the global row statistics), as in
Megatron's vocab-parallel cross entropy, so gradients are exact.

Memory: the rows (tokens) are processed in chunks of about ``chunk_elements``
logits, each upcast to fp32 only while it is processed. Autograd keeps the
input logits in their own dtype (no fp32 copy) plus a few fp32 numbers per row,
and backward recomputes the softmax chunk by chunk into one gradient tensor of
the logits' shape and dtype. The naive version keeps several fp32 [b, s, V]
copies alive (see benchmarks/logprobs.py for the measured difference).

Alignment (docs/architecture.md#values): ``logprobs[:, t]`` is log π(y_t | y_<t), read from
the logits at position ``t - 1``; position 0 has no prediction and gets 0.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

DEFAULT_CHUNK_ELEMENTS = 2**24
"""Logits per chunk: bounds the fp32 temporaries (two of this size, 64 MiB each) in forward and backward."""


def _group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _row_blocks(num_b: int, num_s: int, rows: int) -> Iterator[tuple[slice, slice]]:
    """(batch slice, position slice) blocks of at most ``rows`` rows covering [num_b, num_s]."""
    if rows >= num_s:
        step = rows // num_s
        for b0 in range(0, num_b, step):
            yield slice(b0, min(b0 + step, num_b)), slice(0, num_s)
        return
    for b in range(num_b):
        for t0 in range(0, num_s, rows):
            yield slice(b, b + 1), slice(t0, min(t0 + rows, num_s))


def _scaled_copy(block: torch.Tensor, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """A fresh ``dtype`` copy of ``block`` divided by the temperature (safe to modify in place)."""
    x = block.to(dtype, copy=True)
    return x.div_(temperature) if temperature != 1.0 else x


class _VocabParallelLogprobs(torch.autograd.Function):
    """Chunked vocab-parallel log p(target) and entropy; see the module docstring.

    Inputs: logits_bsv [b, s, V_local] (any float dtype, any strides), targets_bs [b, s] global ids
    (a negative id means "no target": that row's log-prob is meaningless and must get zero gradient).
    Outputs: logprobs [b, s] and, with entropy, entropy [b, s], in fp32 (fp64 for fp64 logits).
    """

    @staticmethod
    def forward(ctx, logits_bsv, targets_bs, group, vocab_size, temperature, with_entropy, chunk_elements):
        tp_rank, tp_size = _group_rank_size(group)
        v_local = logits_bsv.shape[-1]
        num_valid = min(max(vocab_size - tp_rank * v_local, 0), v_local)  # columns past it are TP padding
        local_ids = targets_bs - tp_rank * v_local
        has_target = (local_ids >= 0) & (local_ids < num_valid)
        dtype = torch.promote_types(logits_bsv.dtype, torch.float32)
        stats = _local_stats(logits_bsv, local_ids, has_target, num_valid=num_valid, temperature=temperature,
                             dtype=dtype, with_entropy=with_entropy, chunk_elements=chunk_elements)
        row_max, log_z, target, entropy = _combine(stats, group, tp_size)
        logprobs = (target - row_max - log_z).masked_fill(targets_bs >= vocab_size, float("-inf"))
        ctx.save_for_backward(logits_bsv, local_ids, has_target, row_max, log_z,
                              *([entropy] if with_entropy else []))
        ctx.params = (num_valid, temperature, chunk_elements)
        return (logprobs, entropy) if with_entropy else logprobs

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy=None):
        logits_bsv, local_ids, has_target, row_max, log_z, *entropy = ctx.saved_tensors
        num_valid, temperature, chunk_elements = ctx.params
        grad = torch.zeros(logits_bsv.shape, dtype=logits_bsv.dtype, device=logits_bsv.device)
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(row_max)
        rows = (row_max, log_z, grad_logprobs, torch.where(has_target, grad_logprobs, 0.0), local_ids,
                *((entropy[0], grad_entropy) if entropy and grad_entropy is not None else ()))
        blocks = _row_blocks(*logits_bsv.shape[:2], max(1, chunk_elements // num_valid)) if num_valid else ()
        for bs, ts in blocks:
            # One statement: the chunk's temporaries are freed before the next chunk allocates its own.
            grad[bs, ts, :num_valid].copy_(_chunk_grad(logits_bsv[bs, ts, :num_valid], [r[bs, ts] for r in rows],
                                                       temperature))
        return grad, None, None, None, None, None, None


def _local_stats(logits_bsv, local_ids, has_target, *, num_valid, temperature, dtype, with_entropy,
                 chunk_elements) -> torch.Tensor:
    """Per-row statistics of this rank's valid columns, relative to the local row max m.

    Returns [3 or 4, b, s]: m, Σ exp(x - m), the target logit (0 off this slice) and,
    with entropy, Σ exp(x - m)·(x - m); x = logits / temperature.
    """
    b, s, _ = logits_bsv.shape
    stats = torch.zeros((4 if with_entropy else 3, b, s), dtype=dtype, device=logits_bsv.device)
    stats[0] = float("-inf")
    if num_valid == 0:
        return stats
    for bs, ts in _row_blocks(b, s, max(1, chunk_elements // num_valid)):
        stats[:, bs, ts] = _chunk_stats(_scaled_copy(logits_bsv[bs, ts, :num_valid], temperature, dtype),
                                        local_ids[bs, ts], has_target[bs, ts], with_entropy)
    return stats


def _chunk_stats(x, local_ids, has_target, with_entropy: bool) -> torch.Tensor:
    """[3 or 4, bb, tt] local stats (see _local_stats) of one scaled chunk x [bb, tt, num_valid], used up."""
    picked = x.gather(-1, local_ids.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    row_max = x.amax(dim=-1)
    shifted = x.sub_(row_max.unsqueeze(-1))
    exp = shifted.exp() if with_entropy else shifted.exp_()  # the entropy term needs both
    out = [row_max, exp.sum(dim=-1), torch.where(has_target, picked, 0.0)]
    if with_entropy:
        out.append(exp.mul_(shifted).sum(dim=-1))
    return torch.stack(out)


def _chunk_grad(block, rows: list[torch.Tensor], temperature: float) -> torch.Tensor:
    """d loss / d logits [bb, tt, num_valid] for one chunk ``block`` of logits.

    rows: per-row [bb, tt] tensors: global max, log Z, grad of log p, that grad where the target
    is in this slice (else 0), local target id, and optionally entropy and its grad.
    """
    row_max, log_z, grad_lp, target_grad, local_ids, *ent = (r.unsqueeze(-1) for r in rows)
    log_p = _scaled_copy(block, temperature, row_max.dtype).sub_(row_max).sub_(log_z)
    if ent:  # d/ds_k [a·log p_t + c·H] = a·(1[k=t] - p_k) - c·p_k·(log p_k + H)
        p = log_p.exp()
        d = log_p.add_(ent[0]).mul_(ent[1]).add_(grad_lp).mul_(p).neg_()
    else:
        d = log_p.exp_().mul_(-grad_lp)
    d.scatter_add_(-1, local_ids.clamp(0, block.shape[-1] - 1), target_grad)
    return d.div_(temperature) if temperature != 1.0 else d


def _combine(stats: torch.Tensor, group, tp_size: int):
    """Global (row max, log Z, target logit, entropy or None) from every rank's local stats.

    Rescales the local sums to the global max M: Σ e^{x-M} = e^{m-M}·Σ e^{x-m} and
    Σ e^{x-M}(x-M) = e^{m-M}·(Σ e^{x-m}(x-m) + (m-M)·Σ e^{x-m}); then H = log Z - E_p[x - M].
    Two collectives in all (MAX, then one SUM of the stacked sums).
    """
    local_max = stats[0]
    row_max = local_max.clone()
    if tp_size > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    scale = torch.exp(local_max - row_max)  # 0 where this rank has no valid column (m = -inf)
    sums = [stats[1] * scale, stats[2]]
    if stats.shape[0] == 4:
        gap = torch.where(stats[1] > 0, local_max - row_max, 0.0)
        sums.append(scale * (stats[3] + gap * stats[1]))
    sums = torch.stack(sums)
    if tp_size > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    log_z = sums[0].log()
    entropy = log_z - sums[2] / sums[0] if stats.shape[0] == 4 else None
    return row_max, log_z, sums[1], entropy


def vocab_parallel_logprobs(logits_nv: torch.Tensor, targets_n: torch.Tensor, *,
                            tp_group: dist.ProcessGroup | None, vocab_size: int,
                            with_entropy: bool = True, temperature: float = 1.0,
                            chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and entropy for each row of a vocab-sharded logit matrix.

    logits_nv: [..., V_local] logits (any float dtype) of this TP rank's vocab slice
    (global columns ``[rank * V_local, (rank + 1) * V_local)``); columns >= ``vocab_size``
    are TP padding and are excluded from the softmax. targets_n: [...] global token ids in
    ``[0, vocab_size)`` (an id >= vocab_size gets -inf). ``temperature`` divides the logits.
    Returns (logprobs [...], entropy [...] or None), fp32 (fp64 for fp64 logits).
    """
    lead = targets_n.shape
    if logits_nv.dim() == 1:
        logits_nv, targets_n = logits_nv.unsqueeze(0), targets_n.unsqueeze(0)
    logits_bsv = logits_nv.reshape(-1, *logits_nv.shape[-2:])  # a view when the leading dims are contiguous
    out = _apply(logits_bsv, targets_n.reshape(logits_bsv.shape[:2]), tp_group, vocab_size, temperature,
                 with_entropy, chunk_elements)
    return out[0].reshape(lead), (out[1].reshape(lead) if out[1] is not None else None)


def _apply(logits_bsv, targets_bs, group, vocab_size, temperature, with_entropy, chunk_elements):
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1 (got {chunk_elements}); the default is 2**24")
    out = _VocabParallelLogprobs.apply(logits_bsv, targets_bs, group, vocab_size, float(temperature),
                                       with_entropy, chunk_elements)
    return out if with_entropy else (out, None)


def token_logprobs(logits_bsv: torch.Tensor, tokens_bs: torch.Tensor, *, tp_group: dist.ProcessGroup | None,
                   vocab_size: int, temperature: float = 1.0, with_entropy: bool = True,
                   chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of ``tokens_bs`` (and entropies) aligned with the tokens.

    logits_bsv: [b, s, V_local] vocab-parallel logits (GPTModel output with parallel_output=True),
    any float dtype (upcast to fp32 per chunk, never as a whole); tokens_bs: [b, s].
    Returns (logprobs [b, s], entropy [b, s] or None), fp32 (fp64 for fp64 logits), column 0 = 0.
    ``temperature`` divides the logits first (match the engine's sampling distribution).
    """
    # Row t predicts token t + 1; the last row predicts nothing (-1: no target, zero gradient).
    # Passing the whole tensor (not logits_bsv[:, :-1]) lets backward write one full-shape gradient.
    targets_bs = torch.cat([tokens_bs[:, 1:], tokens_bs.new_full((tokens_bs.shape[0], 1), -1)], dim=1)
    lp, ent = _apply(logits_bsv, targets_bs, tp_group, vocab_size, temperature, with_entropy, chunk_elements)
    return _shift_right(lp[:, :-1]), (_shift_right(ent[:, :-1]) if ent is not None else None)


def _shift_right(x_bn: torch.Tensor) -> torch.Tensor:
    """[b, s-1] predictions -> [b, s] aligned with the predicted tokens (column 0 = 0)."""
    return torch.cat([x_bn.new_zeros(x_bn.shape[0], 1), x_bn], dim=1)
