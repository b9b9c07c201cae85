"""Transformer layer specs: Transformer Engine on GPU machines, megatron-core local modules otherwise.

The local spec differs from megatron's ``get_gpt_layer_local_spec`` in two ways:
- norms come from ``LocalNorm``, which supports sequence parallelism (megatron's
  ``WrappedTorchNorm`` asserts it off) by tagging its weights ``sequence_parallel``
  so their partial gradients are summed over the TP group, as TE's norms do;
- MoE layers store their pre-MLP norm under ``pre_mlp_layernorm.*`` in sharded
  state dicts, the key the TE spec uses (megatron's local spec maps it to
  ``mlp.linear_fc1.layer_norm_*``, which exists only in TE *dense* layers), so
  checkpoints written on CPU load into the TE model on GPU and back.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_mlp_module_spec_for_backend,
)
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from sao_megatron.models.arch import moe_layer_mask


def transformer_engine_usable(device: torch.device | None = None) -> bool:
    """TE specs need both the TE package and a CUDA training device (``device``: the run's, from
    ``resources.device``; None asks torch whether CUDA is available)."""
    from megatron.core.extensions.transformer_engine import HAVE_TE

    on_cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    return bool(HAVE_TE) and on_cuda


def init_device(config: TransformerConfig) -> torch.device:
    """Where a module built outside Megatron's own layers must create its parameters: Megatron's
    convention (``use_cpu_initialization`` on CPU machines, else the current CUDA device). Modules
    created on the CPU on a GPU node reach the device only through the distributed optimizer's
    buffers, if at all, and the first forward fails. With ``use_cpu_initialization`` megatron's
    layers take torch's default device (the CPU; ``meta`` in a parameter-counting build), so do we."""
    if config.use_cpu_initialization:
        return torch.get_default_device()
    return torch.device("cuda", torch.cuda.current_device())


class LocalNorm:
    """torch RMSNorm/LayerNorm builder that also works with sequence parallelism.

    Called like every megatron norm builder: ``LocalNorm(config=..., hidden_size=..., eps=...)``.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        norm_cls = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}.get(config.normalization)
        if norm_cls is None:
            raise ValueError(f"normalization={config.normalization!r} is not supported; use RMSNorm or LayerNorm")
        norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype, device=init_device(config))
        for param in norm.parameters():
            # Under SP each TP rank normalises its own sequence shard: the weight gradient is a
            # partial sum that finalize_model_grads all-reduces over TP for params tagged like this.
            param.sequence_parallel = config.sequence_parallel
        return norm


def local_layer_spec(config: TransformerConfig, *, moe: bool) -> ModuleSpec:
    """One transformer layer from megatron-core modules only (CPU-capable)."""
    backend = LocalSpecProvider()
    mlp = get_mlp_module_spec_for_backend(backend=backend, num_experts=config.num_moe_experts if moe else None,
                                          moe_grouped_gemm=False)
    keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    if not moe:  # TE fuses the pre-MLP norm into linear_fc1 only in dense layers
        keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    qk_norm = LocalNorm if config.qk_layernorm else IdentityOp
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=LocalNorm,
        self_attention=ModuleSpec(
            module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=backend.column_parallel_linear(), core_attention=backend.core_attention(),
                linear_proj=backend.row_parallel_linear(), q_layernorm=qk_norm, k_layernorm=qk_norm)),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=LocalNorm,
        mlp=mlp,
        mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map=keys_map))


def decoder_block_spec(config: TransformerConfig, *, use_te: bool, pp_rank: int,
                       vp_stage: int | None) -> TransformerBlockSubmodules:
    """Layer specs of the layers this (pp_rank, vp_stage) builds, plus the final norm."""
    if getattr(config, "multi_latent_attention", False):
        return latent_decoder_block_spec(config, use_te=use_te, pp_rank=pp_rank, vp_stage=vp_stage)
    if use_te:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization=config.normalization,
                                          vp_stage=vp_stage, pp_rank=pp_rank)
    specs = {0: local_layer_spec(config, moe=False), 1: local_layer_spec(config, moe=True)}
    layers = [specs[kind] for kind in moe_layer_mask(config)]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=layers[offset: offset + count], layer_norm=LocalNorm)


# --------------------------------------------------------------------------- multi-head latent attention
class LocalLinear(torch.nn.Linear):
    """Unsharded linear layer with megatron's builder signature, returning ``(output, None)``.

    The CPU stand-in for ``TELinear(parallel_mode="duplicated")``: the DSA indexer's projections are
    replicated on every TP rank (megatron's local backend has no such module).
    """

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, init_method=None,
                 bias: bool = False, **_unused):
        # On the init device like every megatron layer: created on the CPU, a GPU run without TE
        # (this spec) would fail at the first forward (the optimizer never moves it).
        super().__init__(input_size, output_size, bias=bias, dtype=config.params_dtype, device=init_device(config))
        if init_method is not None:
            with torch.no_grad():
                init_method(self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return super().forward(x), None


class LocalMLACoreAttention(torch.nn.Module):
    """Causal softmax attention whose q/k and v head sizes differ (megatron's local one assumes equal).

    Built by MLASelfAttention like DotProductAttention; inputs [s, b, heads, dim], output
    [s, b, heads * v_dim]. ``attention_mask`` (bool, True = masked) is combined with causality.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type=None, attention_type=None,
                 softmax_scale: float | None = None, k_channels: int | None = None, **_unused):
        super().__init__()
        self.softmax_scale = softmax_scale if softmax_scale is not None else (k_channels or config.kv_channels) ** -0.5

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **_unused) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError("packed sequences need the Transformer Engine MLA attention (GPU)")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.softmax_scale
        sq, sk = scores.shape[-2:]
        masked = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(1 + sk - sq)
        if attention_mask is not None:
            masked = masked | attention_mask.bool()
        probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)  # [b, heads, s, v_dim]
        return out.permute(2, 0, 1, 3).reshape(sq, out.shape[0], -1)


MLA_LATENT_NORM_EPS = 1e-6
"""DeepSeek-V3 and GLM-5 build q_a_layernorm / kv_a_layernorm with the RMSNorm default eps (1e-6),
whatever ``rms_norm_eps`` says (GLM-5: 1e-5); megatron would use layernorm_epsilon."""


class LatentNorm:
    """LocalNorm with MLA_LATENT_NORM_EPS: the q/kv latent norms of MLA."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        return LocalNorm(config=config, hidden_size=hidden_size, eps=MLA_LATENT_NORM_EPS)


def _latent_eps_norm(norm_cls: type) -> type:
    """``norm_cls`` built with ``eps=MLA_LATENT_NORM_EPS`` whatever eps megatron passes."""
    class LatentEpsNorm:
        def __new__(cls, *args, **kwargs):
            return norm_cls(*args, **{**kwargs, "eps": MLA_LATENT_NORM_EPS})
    LatentEpsNorm.__name__ = LatentEpsNorm.__qualname__ = f"LatentEps{norm_cls.__name__}"
    LatentEpsNorm.wrapped = norm_cls
    return LatentEpsNorm


def _latent_eps_norm_linear(linear_cls: type) -> type:
    """A fused norm + linear (TE's ``TELayerNormColumnParallelLinear``, which reads its eps from
    ``config.layernorm_epsilon``) built with a config copy whose ``layernorm_epsilon`` is MLA_LATENT_NORM_EPS."""
    class LatentEpsNormLinear:
        def __new__(cls, *args, config: TransformerConfig, **kwargs):
            latent = copy.copy(config)
            latent.layernorm_epsilon = MLA_LATENT_NORM_EPS
            return linear_cls(*args, config=latent, **kwargs)
    LatentEpsNormLinear.__name__ = LatentEpsNormLinear.__qualname__ = f"LatentEps{linear_cls.__name__}"
    LatentEpsNormLinear.wrapped = linear_cls
    return LatentEpsNormLinear


def with_latent_norm_eps(block: TransformerBlockSubmodules, config: TransformerConfig) -> TransformerBlockSubmodules:
    """A copy of an MLA block spec (TE's) whose q/kv latent norms use MLA_LATENT_NORM_EPS.

    Megatron builds them with ``layernorm_epsilon`` (GLM-5: 1e-5), transformers with 1e-6. TE's
    MLA spec either has separate ``q_layernorm``/``kv_layernorm`` (DSA's absorbed MLA) or, with
    ``qk_layernorm``, fuses them into ``linear_q_up_proj``/``linear_kv_up_proj`` (norm + linear);
    both are rebuilt with the latent eps. Every other module is left as megatron made it.
    """
    layers = []
    for layer in block.layer_specs:
        attn_spec = layer.submodules.self_attention
        sub = copy.copy(attn_spec.submodules)
        fused = config.qk_layernorm and sub.kv_layernorm is IdentityOp
        for name in ("q_layernorm", "kv_layernorm"):
            if getattr(sub, name) is not IdentityOp:
                setattr(sub, name, _latent_eps_norm(getattr(sub, name)))
        for name in ("linear_q_up_proj", "linear_kv_up_proj") if fused else ():
            if name == "linear_kv_up_proj" or config.q_lora_rank:
                setattr(sub, name, _latent_eps_norm_linear(getattr(sub, name)))
        attn = dataclasses.replace(attn_spec, submodules=sub)
        layers.append(dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attn)))
    return dataclasses.replace(block, layer_specs=layers)


def local_mla_attention_spec(config: TransformerConfig) -> ModuleSpec:
    """MLA self-attention from megatron-core modules (DSA: absorbed MLA + the sparse-attention core).

    The q/kv down projections are ``ColumnParallelLinear`` (megatron gathers their output over TP),
    so every tensor is either TP-sharded along dim 0 or replicated, as the converters expect.
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules

    norm = LatentNorm if config.qk_layernorm else IdentityOp
    linears = dict(linear_q_proj=ColumnParallelLinear, linear_q_down_proj=ColumnParallelLinear,
                   linear_q_up_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear,
                   linear_kv_up_proj=ColumnParallelLinear, linear_proj=RowParallelLinear,
                   q_layernorm=norm if config.q_lora_rank else IdentityOp, kv_layernorm=norm)
    if config.experimental_attention_variant != "dsa":
        return ModuleSpec(module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                          submodules=MLASelfAttentionSubmodules(core_attention=LocalMLACoreAttention, **linears))
    from megatron.core.transformer.experimental_attention_variant.absorbed_mla import (
        AbsorbedMLASelfAttention, AbsorbedMLASelfAttentionSubmodules,
    )
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexer, DSAIndexerSubmodules, DSAttention, DSAttentionSubmodules,
    )

    indexer = ModuleSpec(module=DSAIndexer, submodules=DSAIndexerSubmodules(
        linear_wq_b=LocalLinear, linear_wk=LocalLinear, k_norm=LocalNorm, linear_weights_proj=LocalLinear))
    core = ModuleSpec(module=DSAttention, submodules=DSAttentionSubmodules(indexer=indexer))
    return ModuleSpec(module=AbsorbedMLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=AbsorbedMLASelfAttentionSubmodules(core_attention=core, **linears))


def local_mla_layer_spec(config: TransformerConfig, *, moe: bool) -> ModuleSpec:
    """One MLA (optionally DSA) transformer layer from megatron-core modules (CPU-capable)."""
    mlp = get_mlp_module_spec_for_backend(backend=LocalSpecProvider(),
                                          num_experts=config.num_moe_experts if moe else None, moe_grouped_gemm=False)
    keys_map = {} if moe else {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=LocalNorm, self_attention=local_mla_attention_spec(config),
        self_attn_bda=get_bias_dropout_add, pre_mlp_layernorm=LocalNorm, mlp=mlp, mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map=keys_map))


def latent_decoder_block_spec(config: TransformerConfig, *, use_te: bool, pp_rank: int,
                              vp_stage: int | None) -> TransformerBlockSubmodules:
    """Layer specs of an MLA model's layers on this (pp_rank, vp_stage), plus the final norm."""
    if use_te and config.experimental_attention_variant == "dsa":
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        return with_latent_norm_eps(get_transformer_block_with_experimental_attention_variant_spec(
            config, vp_stage=vp_stage, pp_rank=pp_rank), config)
    if use_te:
        return with_latent_norm_eps(get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization=config.normalization, vp_stage=vp_stage,
            pp_rank=pp_rank), config)
    specs = {0: local_mla_layer_spec(config, moe=False), 1: local_mla_layer_spec(config, moe=True)}
    layers = [specs[kind] for kind in moe_layer_mask(config)]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=layers[offset: offset + count], layer_norm=LocalNorm)
