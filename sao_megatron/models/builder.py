"""The one place that turns our configs into Megatron's TransformerConfig and GPTModel.

Qwen3-MoE family (and GLM-4.5-style options): RMSNorm, per-head q/k RMSNorm,
GQA, RoPE (base, partial rotary), SwiGLU experts routed top-k, optional shared
experts, dense layers via ``moe_layer_freq``, sigmoid router + expert bias +
top-k scaling, QKV bias. Field names are Megatron's, so most are copied as is.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from sao_megatron.config.schema import ModelConfig, ParallelConfig
from sao_megatron.models.arch import VOCAB_DIVISIBLE_BY, padded_vocab_size  # noqa: F401 (VOCAB_: re-exported)
from sao_megatron.models.specs import decoder_block_spec, transformer_engine_usable
from sao_megatron.parallel.cpu_support import apply_dsa_hadamard_fallback

if TYPE_CHECKING:
    from sao_megatron.parallel.bootstrap import ParallelContext

logger = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# ModelConfig fields whose name and meaning are exactly Megatron's TransformerConfig ones.
_SAME_NAME_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_shared_expert_intermediate_size",
    "moe_router_score_function", "moe_router_pre_softmax", "moe_router_enable_expert_bias",
    "moe_router_topk_scaling_factor", "moe_router_dtype", "moe_aux_loss_coeff", "moe_token_dispatcher_type",
    "qk_layernorm", "add_qkv_bias", "normalization", "layernorm_epsilon", "init_method_std",
)
_PARALLEL_FIELDS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "context_parallel_size", "sequence_parallel",
)


RECOMPUTE_CHOICES = ("none", "selective", "full")


def recompute_fields(granularity: str, *, use_te: bool = False, grouped_gemm: bool = False) -> dict:
    """Megatron's activation-recompute fields for ``actor/critic.recompute_granularity``.

    ``full``: every transformer layer is one checkpointed unit (uniform, 1 layer per unit): only
    each layer's input is kept, the rest is recomputed in backward (the planner's `full` estimate).
    ``selective``: with Transformer Engine core attention, the norms and (grouped GEMM experts) the
    MoE activation, the set the planner's `selective` estimate drops; without TE only core
    attention (Megatron's norm recompute needs TE, its MoE-activation recompute grouped GEMM).
    """
    if granularity not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute_granularity must be one of {RECOMPUTE_CHOICES}, got {granularity!r}")
    if granularity == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if granularity == "selective":
        modules = ["core_attn"] + (["layernorm"] if use_te else []) + (["moe_act"] if grouped_gemm else [])
        return dict(recompute_granularity="selective", recompute_modules=modules)
    return {}


def build_transformer_config(model: ModelConfig, parallel: ParallelConfig, *, use_te: bool | None = None,
                             recompute: str = "none", on_cpu: bool | None = None) -> TransformerConfig:
    """Megatron TransformerConfig for actor and critic trunks (no process groups needed).

    ``recompute``: ``none``, ``selective`` or ``full`` activation recomputation (``recompute_fields``).
    ``on_cpu``: the run trains on the CPU (``ctx.device``); None asks torch whether CUDA is available.
    """
    use_te = transformer_engine_usable() if use_te is None else use_te
    dtype = _DTYPES[model.params_dtype]
    kwargs = {name: getattr(model, name) for name in _SAME_NAME_FIELDS}
    kwargs |= {name: getattr(parallel, name) for name in _PARALLEL_FIELDS}
    is_moe = model.num_moe_experts is not None
    pp = parallel.pipeline_model_parallel_size
    kwargs |= dict(
        moe_layer_freq=model.moe_layer_freq if is_moe else 1,
        moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff > 0 else "none",
        # The expert bias is part of the policy the engines serve: RL keeps it fixed.
        moe_router_bias_update_rate=0.0,
        moe_grouped_gemm=is_moe and use_te,
        # Qwen3/GLM: SwiGLU, no biases except the optional QKV bias (SequentialMLP with bias also
        # fails an in-place view check on CPU).
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        # RL needs deterministic log-probs: the trainer's must match the engine's.
        hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available() if on_cpu is None else on_cpu,
        # Micro-batches have different lengths: 1F1B pipelines exchange shapes. Not with the allgather
        # dispatcher (Megatron forbids it) nor interleaving (deadlocks on gloo): training.step.forward pads.
        variable_seq_lengths=(pp > 1 and not parallel.virtual_pipeline_model_parallel_size
                              and model.moe_token_dispatcher_type != "allgather"),
        bias_activation_fusion=use_te, bias_dropout_fusion=use_te, masked_softmax_fusion=use_te,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        # Losses arrive pre-normalised by global counts (training.step.forward): Megatron must not divide
        # by the number of micro-batches nor average over DP; gradients are summed.
        calculate_per_token_loss=True,
        # Free pipeline outputs after sending them; the schedules then call the autograd engine
        # directly (which also keeps the CPU device mode active inside custom backwards).
        deallocate_pipeline_outputs=True,
    )
    kwargs |= recompute_fields(recompute, use_te=use_te, grouped_gemm=kwargs["moe_grouped_gemm"])
    kwargs |= {name: getattr(model, name) for name in _GROUP_ROUTING_FIELDS}
    if model.multi_latent_attention:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig(**kwargs, **latent_attention_fields(model, use_te=use_te))
    return TransformerConfig(**kwargs)


# Group-limited routing (DeepSeek-V3 n_group / topk_group); None (Megatron's default) = no groups.
_GROUP_ROUTING_FIELDS = ("moe_router_num_groups", "moe_router_group_topk")
_MLA_FIELDS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
               "v_head_dim", "rope_type", "rotary_base", "rotary_percent", "rotary_scaling_factor",
               "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
_DSA_FIELDS = ("experimental_attention_variant", "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk",
               "dsa_indexer_topk_freq", "dsa_indexer_skip_topk_offset", "dsa_indexer_rope_interleaved",
               "dsa_indexer_rotate_activation", "dsa_indexer_k_norm_epsilon")


def latent_attention_fields(model: ModelConfig, *, use_te: bool) -> dict:
    """MLATransformerConfig fields of an MLA (and DSA) model (DeepSeek-V3, GLM-5).

    The local backend is named explicitly: megatron resolves MLA's q/kv norms through it.
    DSA: ``dsa_kernel_backend`` picks megatron's kernels (docs/mla-dsa.md: ``none`` materialises
    quadratic fp32 scores, ``tilelang`` is fused and sparse; megatron refuses it without CUDA and
    tilelang). The indexer's KL loss against the main attention is megatron's own
    (``dsa_indexer_loss_coeff``, sparse: over the selected keys, as DeepSeek-V3.2 trains it); off
    by default, and then the indexer is frozen so trainer and engines select the same keys.
    """
    fields = {name: getattr(model, name) for name in _MLA_FIELDS}
    fields["transformer_impl"] = "transformer_engine" if use_te else "local"
    if model.experimental_attention_variant == "dsa":
        coeff = model.dsa_indexer_loss_coeff
        if coeff < 0:
            raise ValueError(f"model.dsa_indexer_loss_coeff={coeff} must be >= 0 (0 = no indexer loss)")
        fields |= {name: getattr(model, name) for name in _DSA_FIELDS}
        fields |= dict(dsa_kernel_backend=model.dsa_kernel_backend, dsa_indexer_loss_coeff=coeff or None,
                       dsa_indexer_use_sparse_loss=coeff > 0)
    elif model.dsa_indexer_loss_coeff or model.dsa_kernel_backend != "none":
        raise ValueError("model.dsa_indexer_loss_coeff / dsa_kernel_backend apply to DSA models only "
                         "(experimental_attention_variant: dsa): leave them at 0 / none")
    return fields


def is_first_chunk(ctx: ParallelContext, vp_stage: int | None) -> bool:
    return ctx.pp_rank == 0 and (vp_stage is None or vp_stage == 0)


def is_last_chunk(ctx: ParallelContext, vp_stage: int | None) -> bool:
    vpp = ctx.vpp_size
    return ctx.pp_rank == ctx.pp_size - 1 and (vp_stage is None or vpp is None or vp_stage == vpp - 1)


def build_gpt_model(model: ModelConfig, ctx: ParallelContext, *, vp_stage: int | None = None,
                    value_head: bool = False, config: TransformerConfig | None = None,
                    use_te: bool | None = None) -> GPTModel:
    """One model chunk for this rank (pipeline stage ``ctx.pp_rank``, virtual stage ``vp_stage``).

    ``value_head=True`` replaces the LM head by a scalar head (critic); the forward then
    returns values [b, s, 1] instead of vocab-parallel logits [b, s, padded_vocab / tp].
    ``use_te``: Transformer Engine specs (default: when TE and a GPU are present).
    """
    use_te = transformer_engine_usable(ctx.device) if use_te is None else use_te
    config = config or build_transformer_config(model, ctx.parallel, use_te=use_te, on_cpu=ctx.device.type == "cpu")
    spec = decoder_block_spec(config, use_te=use_te, pp_rank=ctx.pp_rank, vp_stage=vp_stage)
    gpt = GPTModel(
        config=config, transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(model.vocab_size, ctx.tp_size),
        max_sequence_length=model.max_position_embeddings,
        pre_process=is_first_chunk(ctx, vp_stage), post_process=is_last_chunk(ctx, vp_stage),
        parallel_output=True,
        share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights and not value_head,
        position_embedding_type="rope", rotary_percent=model.rotary_percent, rotary_base=model.rotary_base,
        pg_collection=ctx.pg, vp_stage=vp_stage)
    if value_head and gpt.post_process:
        from sao_megatron.models.critic import attach_value_head

        attach_value_head(gpt, tp_group=ctx.tp_group)
    return gpt


def build_model_chunks(model: ModelConfig, ctx: ParallelContext, *, value_head: bool = False,
                       use_te: bool | None = None, recompute: str = "none") -> list[GPTModel]:
    """All model chunks of this rank: one, or ``virtual_pipeline_model_parallel_size`` with interleaved PP."""
    use_te = transformer_engine_usable(ctx.device) if use_te is None else use_te
    config = build_transformer_config(model, ctx.parallel, use_te=use_te, recompute=recompute,
                                      on_cpu=ctx.device.type == "cpu")
    if model.experimental_attention_variant == "dsa":
        apply_dsa_hadamard_fallback(ctx.device)
    if value_head and getattr(config, "dsa_indexer_loss_coeff", None):
        config.dsa_indexer_loss_coeff = None  # the critic's attention (indexer included) is frozen: no KL loss
    stages = [None] if ctx.vpp_size is None or ctx.pp_size == 1 else list(range(ctx.vpp_size))
    chunks = [build_gpt_model(model, ctx, vp_stage=s, value_head=value_head, config=config, use_te=use_te)
              for s in stages]
    if torch.get_default_device().type == "meta":
        # A parameter-counting build (planning): nothing to move. Its buffers may lie elsewhere: megatron
        # creates the router's token counts and the rotary caches with an explicit device, which beats
        # the default device.
        check_on_device(chunks, torch.device("meta"), buffers=False)
    else:
        check_on_device(chunks, place_on_device(chunks, ctx.device))
    if value_head or not model.dsa_indexer_loss_coeff:  # trained only by its KL loss, in the actor
        freeze_dsa_indexer(chunks)
    return chunks


def place_on_device(chunks: list[torch.nn.Module], device: torch.device) -> torch.device:
    """Move every chunk to the training device after building it, as Megatron's ``get_model`` does
    (``module.cuda(torch.cuda.current_device())``); returns the device its tensors must now be on.

    Megatron leaves some tensors for this move on purpose: ``TopKRouter`` creates its weight without
    a device ("TODO: Add support for GPU initialization"). Parameters keep their Python attributes
    (Megatron's tensor-parallel, sequence-parallel and expert tags) also where torch converts by making
    new Parameters instead of setting ``.data`` (e.g. CPU -> meta under the ``CudaToMetaMode`` emulation).
    """
    for chunk in chunks:
        tags = {name: dict(vars(p)) for name, p in chunk.named_parameters() if vars(p)}
        chunk.to(device=device)
        for name, p in chunk.named_parameters():
            for key, value in tags.get(name, {}).items():
                if not hasattr(p, key):
                    setattr(p, key, value)
    # Where a tensor sent to ``device`` lands: ``device`` itself, unless a device mode maps it
    # (CudaToCpuMode: the CPU; CudaToMetaMode: meta).
    return torch.empty(0, device=device).device


def check_on_device(chunks: list[torch.nn.Module], device: torch.device, *, buffers: bool = True) -> None:
    """Every parameter and buffer on ``device`` (type and index: ``cuda:1`` is not ``cuda:0``), or a
    clear error naming the first one that is not: a tensor elsewhere would fail only at the first
    forward, or silently run a layer on the CPU. No buffer is exempt after ``place_on_device``: no
    megatron-core 0.19.2 module keeps one on the CPU for the families we build (tests/component/
    test_device_placement.py builds each of them with CUDA placements mapped to ``meta``).
    ``buffers=False``: parameters only (a meta build, see ``build_model_chunks``)."""
    for chunk in chunks:
        tensors = [("parameter", n, t) for n, t in chunk.named_parameters()]
        tensors += [("buffer", n, t) for n, t in chunk.named_buffers()] if buffers else []
        for kind, name, t in tensors:
            if t.device != device:
                raise RuntimeError(f"model {kind} {name} is on {t.device}, the model belongs on {device}: a module "
                                   "created it elsewhere and nothing moved it (place_on_device; a module that "
                                   "overrides _apply/to, or a tensor created after the build)")


def freeze_dsa_indexer(chunks: list[torch.nn.Module]) -> int:
    """requires_grad=False on every DSA indexer parameter; returns how many.

    The top-k is not differentiable, so without its own KL loss (``model.dsa_indexer_loss_coeff``
    0, the default; always for the critic) the policy and value losses give the indexer no
    gradient; left trainable, weight decay alone would move it. Frozen, trainer and engines select
    the same keys for the same tokens (docs/mla-dsa.md).
    """
    frozen = 0
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if ".core_attention.indexer." in name:
                param.requires_grad_(False)
                frozen += 1
    return frozen


def count_parameters(chunks: list[torch.nn.Module]) -> dict[str, int]:
    """Local (this rank's shard) parameter counts: total, trainable, frozen."""
    total = sum(p.numel() for c in chunks for p in c.parameters())
    trainable = sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)
    return {"total": total, "trainable": trainable, "frozen": total - trainable}
