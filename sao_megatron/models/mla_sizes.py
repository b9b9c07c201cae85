"""Sizes of multi-head latent attention (+ the DSA indexer) for the layout planner: pure arithmetic.

Kept beside ``planner.py`` so the planner's GQA formulas stay untouched; these equal the numel
of megatron-core's MLASelfAttention / AbsorbedMLASelfAttention + DSAIndexer (tests compare them
with real Megatron models). Per-rank counts follow the GPU (Transformer Engine) spec: the q/kv
down projections, their norms and the indexer are replicated over TP; q/kv up projections and
the output projection are split. Whole-model counts (tp=1) do not depend on the spec.
"""

from __future__ import annotations

from sao_megatron.config.schema import ModelConfig
from sao_megatron.models.arch import runs_indexer


def indexer_params(m: ModelConfig) -> int:
    """wq_b, wk, k_norm (LayerNorm: weight + bias), weights_proj of one DSA indexer."""
    n, d = m.dsa_indexer_n_heads or 0, m.dsa_indexer_head_dim or 0
    return n * d * (m.q_lora_rank or 0) + d * m.hidden_size + 2 * d + n * m.hidden_size


def attention_params(m: ModelConfig, layer: int, tp: int = 1) -> int:
    """Parameters of one layer's MLA attention (and indexer) on one rank of a TP group."""
    h, nh, rope = m.hidden_size, m.num_attention_heads, m.qk_pos_emb_head_dim
    ql, kvl = m.q_lora_rank or 0, m.kv_lora_rank
    q_in = ql if ql else h
    replicated = (ql * h + ql if ql else 0) + (kvl + rope) * h + kvl
    split = nh * (m.qk_head_dim + rope) * q_in + nh * (m.qk_head_dim + m.v_head_dim) * kvl + h * nh * m.v_head_dim
    if m.experimental_attention_variant == "dsa" and runs_indexer(m, layer):
        replicated += indexer_params(m)
    return replicated + split // tp


def kv_bytes_per_token(m: ModelConfig) -> int:
    """bf16 cache of one token over all layers on each GPU: the kv latent + rope key (+ indexer key).

    MLA engines cache the compressed latent, replicated over TP (it is one "head").
    """
    per_layer = m.kv_lora_rank + m.qk_pos_emb_head_dim
    if m.experimental_attention_variant == "dsa":
        per_layer += m.dsa_indexer_head_dim or 0
    return 2 * m.num_layers * per_layer


def attention_activation_bytes(m: ModelConfig, tp: int) -> float:
    """Bytes one token saves for backward in one MLA layer's attention (bf16, flash/sparse attention).

    Inputs of each projection and norm, the up-projected q/k/v (split over TP), the attention
    output and the softmax statistics; the indexer runs without gradient in RL (frozen).
    """
    h, nh, rope = m.hidden_size, m.num_attention_heads, m.qk_pos_emb_head_dim
    ql, kvl = m.q_lora_rank or 0, m.kv_lora_rank
    latents = 2 * (2 * ql + 2 * (kvl + rope) + kvl)
    heads = 2 * nh * (2 * (m.qk_head_dim + rope) + m.v_head_dim + m.v_head_dim) // tp + 4 * nh // tp
    return 2 * h + latents + heads


FUSED_DSA_BACKENDS = ("tilelang", "cudnn")
"""megatron-core 0.19.2's fused DSA kernels (``dsa_kernel_backend``); ``none`` is the unfused path."""


def dsa_attention_bytes(m: ModelConfig, *, tp: int, seq: int, batch: int) -> tuple[float, float]:
    """(bytes saved for backward by one DSA layer, transient peak of one DSA layer) on one rank.

    ``none`` (megatron's unfused path, ``dsa._compute_index_scores`` + ``_unfused_absorbed_dsa_fn``):
    the indexer scores every key, an fp32 ``[s, b, index_heads, s]`` tensor (the indexer is
    replicated over TP), alive twice while ReLU and the head weights make their copies; then
    attention builds fp32 ``[b, heads / tp, s, s]`` scores plus an fp32 ``[b, s, s]`` top-k mask,
    the softmax output beside the scores and its bf16 copy for the value matmul, which (with the
    fp32 softmax output) autograd keeps unless core attention is recomputed. The peak is the larger
    of the two phases (the indexer's tensors are freed before attention starts).
    Fused (``tilelang``/``cudnn``): blockwise kernels, nothing quadratic; what remains is linear in
    ``s * topk``: int32 top-k indices and the kernels' fp32 per-query row statistics.
    """
    if m.experimental_attention_variant != "dsa":
        return 0.0, 0.0
    heads = m.num_attention_heads / tp
    topk = min(m.dsa_indexer_topk or seq, seq)
    if m.dsa_kernel_backend in FUSED_DSA_BACKENDS:
        linear = 4.0 * batch * seq * topk
        return linear, 2 * linear
    square = float(batch) * seq * seq
    indexer_peak = 2 * 4 * square * (m.dsa_indexer_n_heads or 0)
    attention_peak = (2 * 4 + 2) * square * heads + 4 * square
    saved = (4 + 2) * square * heads
    return saved, max(indexer_peak, attention_peak)


def dsa_layers(m: ModelConfig, layers: list[int]) -> int:
    """How many of ``layers`` are DSA attention layers (every layer of a DSA model)."""
    return len(layers) if m.experimental_attention_variant == "dsa" else 0
