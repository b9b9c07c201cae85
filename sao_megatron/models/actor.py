"""Actor: per-token log-probs and entropy from vocab-parallel logits.

With tensor parallelism each rank holds logits for a contiguous slice of the
(padded) vocabulary. The log-softmax is computed without gathering the full
vocabulary: max, sum of exponentials, the target logit and the expected logit
are each reduced over the TP group (forward all-reduce, backward identity, as
in Megatron's vocab-parallel cross entropy), so memory per rank stays
[b, s, V/TP] and gradients are exact.

Alignment (DESIGN.md §1): ``logprobs[:, t]`` is log π(y_t | y_<t), read from
the logits at position ``t - 1``; position 0 has no prediction and gets 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


def _group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def vocab_parallel_logprobs(logits_nv: torch.Tensor, targets_n: torch.Tensor, *,
                            tp_group: dist.ProcessGroup | None, vocab_size: int,
                            with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and entropy for each row of a vocab-sharded logit matrix.

    logits_nv: [..., V_local] fp32 logits of this TP rank's vocab slice
    (global columns ``[rank * V_local, (rank + 1) * V_local)``); columns >= ``vocab_size``
    are TP padding and are excluded from the softmax. targets_n: [...] global token ids.
    Returns (logprobs [...], entropy [...] or None).
    """
    tp_rank, tp_size = _group_rank_size(tp_group)
    v_local = logits_nv.shape[-1]
    start = tp_rank * v_local
    valid_v = torch.arange(start, start + v_local, device=logits_nv.device) < vocab_size
    logits = logits_nv.masked_fill(~valid_v, torch.finfo(logits_nv.dtype).min)

    row_max = logits.detach().amax(dim=-1)
    if tp_size > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - row_max.unsqueeze(-1)
    exp = torch.where(valid_v, shifted.exp(), 0.0)
    sum_exp = _tp_sum(exp.sum(dim=-1), tp_group, tp_size)
    log_z = sum_exp.log()

    local_ids = targets_n - start
    in_slice = (local_ids >= 0) & (local_ids < v_local)
    picked = shifted.gather(-1, local_ids.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _tp_sum(torch.where(in_slice, picked, 0.0), tp_group, tp_size)
    logprobs = target_logit - log_z

    entropy = None
    if with_entropy:
        # H = log Z - E_p[shifted logit]  (all terms relative to the same row max)
        expected = _tp_sum(torch.where(valid_v, exp * shifted, 0.0).sum(dim=-1), tp_group, tp_size)
        entropy = log_z - expected / sum_exp
    return logprobs, entropy


def _tp_sum(x: torch.Tensor, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    """All-reduce over TP in forward, identity in backward (each rank owns its slice's gradient)."""
    return reduce_from_tensor_model_parallel_region(x, group) if size > 1 else x


def token_logprobs(logits_bsv: torch.Tensor, tokens_bs: torch.Tensor, *, tp_group: dist.ProcessGroup | None,
                   vocab_size: int, temperature: float = 1.0,
                   with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of ``tokens_bs`` (and entropies) aligned with the tokens.

    logits_bsv: [b, s, V_local] vocab-parallel logits (GPTModel output with parallel_output=True);
    tokens_bs: [b, s]. Returns (logprobs [b, s], entropy [b, s] or None), fp32, column 0 = 0.
    ``temperature`` divides the logits first (match the engine's sampling distribution).
    """
    logits = logits_bsv[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    lp, ent = vocab_parallel_logprobs(logits, tokens_bs[:, 1:], tp_group=tp_group, vocab_size=vocab_size,
                                      with_entropy=with_entropy)
    return _shift_right(lp), (_shift_right(ent) if ent is not None else None)


def _shift_right(x_bn: torch.Tensor) -> torch.Tensor:
    """[b, s-1] predictions -> [b, s] aligned with the predicted tokens (column 0 = 0)."""
    return torch.cat([x_bn.new_zeros(x_bn.shape[0], 1), x_bn], dim=1)
