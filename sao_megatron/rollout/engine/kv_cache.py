"""Per-request KV caches of the embedded engine, and how decode batches them.

A request's cache is one ``LayerCache`` per layer: ``(keys, values, indexer_keys)``.
keys/values are whatever transformers stores for the layer, ``[1, heads, length, dim]``
(MLA models store their compressed latents as one head). ``indexer_keys`` is the DeepSeek
sparse-attention indexer's own key cache (``DynamicIndexedLayer``, GLM-5 / DeepSeek-V3.2),
``[1, length, index_head_dim]``, or None (no indexer, or a GLM-5 "shared" layer that reuses the
previous layer's top-k). Decode left-pads every request to the longest and stacks them into the
cache class the model itself builds (``DynamicCache(config=...)``), so indexed layers keep their
indexer keys; the attention mask hides the padding from attention and from the indexer's top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicCache

LayerCache = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
KVCache = list[LayerCache]


def cache_length(cache: KVCache) -> int:
    """Tokens held by a request's cache."""
    return int(cache[0][0].shape[2])


def split_rows(past: Cache, lengths: list[int]) -> list[KVCache]:
    """One request cache per batch row of ``past``, dropping row i's left padding (it holds ``lengths[i]``)."""
    total = past.layers[0].keys.shape[2]
    out = []
    for i, n in enumerate(lengths):
        start = total - n
        rows = []
        for layer in past.layers:
            idx = getattr(layer, "indexer_keys", None)
            idx = idx[i:i + 1, start:] if idx is not None and idx.numel() else None
            rows.append((layer.keys[i:i + 1, :, start:], layer.values[i:i + 1, :, start:], idx))
        out.append(rows)
    return out


def stack_rows(caches: list[KVCache], config) -> tuple[DynamicCache, list[int]]:
    """(one left-padded batch cache of the model's own cache class, each request's length)."""
    lengths = [cache_length(c) for c in caches]
    longest = max(lengths)

    def pad(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
        return torch.cat([F.pad(t, (0, 0) * (t.dim() - 1 - dim) + (longest - n, 0))
                          for t, n in zip(tensors, lengths)])

    layers = [(pad([c[li][0] for c in caches], 2), pad([c[li][1] for c in caches], 2))
              for li in range(len(caches[0]))]
    batch = DynamicCache(ddp_cache_data=layers, config=config)
    for li, layer in enumerate(batch.layers):
        indexer = [c[li][2] for c in caches]
        if any(t is None for t in indexer) != all(t is None for t in indexer):
            raise AssertionError(f"layer {li}: indexer keys cached for some requests only")
        if indexer[0] is not None:
            layer.update_indexer(pad(indexer, 1))
    return batch, lengths
