"""Routed experts of one episode, kept per position across partial rollouts (routing replay, R3).

Every ``/generate`` reply of an episode covers the whole sequence it was given: rows
``[0, len(input) + len(output) - 1)`` (SGLang's ``routed_experts``), the routes of each token fed
through the model. A resubmitted turn (abort pause, engine failure) or the next turn of a multi-turn
episode re-prefills the earlier tokens under the weights live *then*, so its rows for those
positions are not the routes that produced the earlier tokens' log-probs. The rule here: **the first
reply that covers a position fixes its route.** Row ``i`` is then the route of the forward whose
logits sampled token ``i + 1`` (for generated tokens), i.e. the weights of ``versions[i + 1]``: old
log-probs are replayed with old routes. Rows of prompt and observation positions come from the
prefill that first fed them. The last token of a sequence is never fed: it has no row.
"""

from __future__ import annotations

import numpy as np


def merge_routes(kept: np.ndarray | None, reply: np.ndarray | None) -> np.ndarray | None:
    """``kept`` extended by the rows of ``reply`` past its end (first reply wins per position).

    kept, reply: int [rows, ...] with equal trailing shape (``[rows, num_layers, topk]`` or flat
    ``[rows, num_layers * topk]``); either may be None (nothing known yet / nothing returned).
    """
    if reply is None or (kept is not None and len(reply) <= len(kept)):
        return kept
    if kept is None or len(kept) == 0:
        return reply
    if kept.shape[1:] != reply.shape[1:]:
        raise ValueError(f"routed_experts rows of shape {reply.shape[1:]} cannot extend rows of shape "
                         f"{kept.shape[1:]}: the engines serve models with different layer/top-k layouts")
    return np.concatenate([kept, reply[len(kept):]])
