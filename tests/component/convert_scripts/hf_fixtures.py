"""Tiny random HF MoE models written like hub checkpoints (hub-style config keys, several shards).

Built with transformers itself (``Qwen3MoeForCausalLM`` / ``Glm4MoeForCausalLM``) so the
reference semantics are HF's, with every tensor perturbed away from its trivial init
(norms != 1, biases != 0, expert score-correction bias != 0) so that a mapping mistake
anywhere changes the logits. ``config.json`` is then rewritten in hub style
(``num_experts`` / ``n_routed_experts``, top-level ``rope_theta`` and
``partial_rotary_factor``), the way real checkpoints on the hub spell it.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

_QWEN = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
         "vocab_size": 100, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "initializer_range": 0.08,
         "tie_word_embeddings": False, "torch_dtype": "float32"}
_GLM = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_act": "silu",
        "vocab_size": 100, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "initializer_range": 0.08,
        "tie_word_embeddings": False, "torch_dtype": "float32", "n_group": 1, "topk_group": 1,
        "num_nextn_predict_layers": 0}

# name -> hub-style config.json. Shapes cover GQA ratios 2/3/1, head_dim != hidden/heads,
# dense first layers, shared expert off (Qwen3) / 1 / 2 (GLM), norm_topk_prob on/off (Qwen3),
# qkv bias, partial rotary, q/k norm on/off (GLM), tied embeddings.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen_gqa2_dense0": {**_QWEN, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
                         "num_experts_per_tok": 2, "moe_intermediate_size": 24, "norm_topk_prob": True,
                         "mlp_only_layers": [0], "decoder_sparse_step": 1, "rope_theta": 5000.0},
    "qwen_gqa3_nonorm_tied": {**_QWEN, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 6, "num_key_value_heads": 2, "num_experts": 6,
                              "num_experts_per_tok": 3, "moe_intermediate_size": 16, "norm_topk_prob": False,
                              "mlp_only_layers": [], "decoder_sparse_step": 1, "rope_theta": 1000000.0,
                              "tie_word_embeddings": True},
    "glm_gqa2_dense0_shared1": {**_GLM, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                                "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
                                "routed_scaling_factor": 2.5, "attention_bias": True, "use_qk_norm": False,
                                "partial_rotary_factor": 0.5, "rope_theta": 10000.0},
    "glm_mha_qknorm_shared2": {**_GLM, "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2,
                               "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 24,
                               "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                               "n_shared_experts": 2, "first_k_dense_replace": 0, "norm_topk_prob": True,
                               "routed_scaling_factor": 1.0, "attention_bias": False, "use_qk_norm": True,
                               "partial_rotary_factor": 0.25, "rope_theta": 20000.0},
}


def build_model(hub_config: dict[str, Any], seed: int = 0):
    """The transformers model (fp32, eager attention) of a hub-style config, perturbed."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: v for k, v in hub_config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    config = AutoConfig.for_model(hub_config["model_type"], **kwargs)
    config.architectures = hub_config["architectures"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("norm.weight") or "layernorm" in name:
                t.add_(0.2 * torch.randn(t.shape, generator=gen))
            elif name.endswith("bias"):
                t.copy_(0.2 * torch.randn(t.shape, generator=gen))
    return model.eval()


def write_hf_dir(name: str, out_dir: str | pathlib.Path, seed: int = 0, max_shard_size: str = "40KB") -> pathlib.Path:
    """Save SHAPES[name] as a sharded hub-style HF directory; returns it."""
    hub = SHAPES[name]
    out = pathlib.Path(out_dir)
    model = build_model(hub, seed)
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    (out / "config.json").write_text(json.dumps(hub, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256, "fixture": name}) + "\n")
    return out
