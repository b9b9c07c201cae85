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
    buffers, if at all, and the first forward fails."""
    if config.use_cpu_initialization:
        return torch.device("cpu")
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


def moe_layer_pattern(config: TransformerConfig) -> list[int]:
    """1 for an MoE layer, 0 for a dense one, per global layer index."""
    if config.num_moe_experts is None:
        return [0] * config.num_layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    return list(freq)


def decoder_block_spec(config: TransformerConfig, *, use_te: bool, pp_rank: int,
                       vp_stage: int | None) -> TransformerBlockSubmodules:
    """Layer specs of the layers this (pp_rank, vp_stage) builds, plus the final norm."""
    if use_te:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=True, normalization=config.normalization,
                                          vp_stage=vp_stage, pp_rank=pp_rank)
    specs = {0: local_layer_spec(config, moe=False), 1: local_layer_spec(config, moe=True)}
    layers = [specs[kind] for kind in moe_layer_pattern(config)]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=layers[offset: offset + count], layer_norm=LocalNorm)
