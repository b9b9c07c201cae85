"""Tiny random DeepSeek-V3 and GLM-5 (glm_moe_dsa) HF checkpoints, written like hub checkpoints.

Built with transformers' own ``DeepseekV3ForCausalLM`` / ``GlmMoeDsaForCausalLM`` (the
reference semantics), every norm/bias perturbed (so a swapped mapping changes the logits),
saved in several shards with a hub-style config.json (``n_routed_experts``,
``rope_scaling`` for YaRN). Shapes cover: YaRN and plain rope, group-limited routing,
dense first layers, shared expert 1/2, an MTP layer, GLM-5 "shared" indexer layers, and an
``index_topk`` below the sequence length so the sparse path selects.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

_DSV3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
         "vocab_size": 96, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "initializer_range": 0.1,
         "tie_word_embeddings": False, "torch_dtype": "float32", "rope_theta": 10000.0,
         "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 4,
         "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
         "moe_intermediate_size": 16, "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
         "rope_interleave": True, "attention_bias": False}
_GLM5 = {**_DSV3, "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "rms_norm_eps": 1e-5,
         "index_n_heads": 4, "index_head_dim": 16, "rope_theta": 20000.0}
for _k in ("scoring_func", "topk_method", "rope_interleave"):
    _GLM5.pop(_k)

SHAPES: dict[str, dict[str, Any]] = {
    # YaRN + group-limited routing (4 groups of 2, 2 groups per token, top-4) + q LoRA + MTP layer.
    "dsv3_yarn_groups_mtp": {**_DSV3, "num_hidden_layers": 2, "q_lora_rank": 24, "n_routed_experts": 8,
                             "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
                             "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
                             "num_nextn_predict_layers": 1,
                             "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                              "mscale_all_dim": 1.0}},
    # Plain rope, no groups, all MoE, 2 shared experts.
    "dsv3_rope_shared2": {**_DSV3, "num_hidden_layers": 2, "q_lora_rank": 16, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 2,
                     "first_k_dense_replace": 0, "routed_scaling_factor": 1.0, "num_nextn_predict_layers": 0},
    # GLM-5: 4 layers (1 dense), indexer full/shared/full/shared, top-k 8 < sequence length, MTP layer.
    "glm5_shared_idx_mtp": {**_GLM5, "num_hidden_layers": 4, "q_lora_rank": 24, "n_routed_experts": 4,
                            "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
                            "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "index_topk": 8,
                            "indexer_types": ["full", "shared", "full", "shared"], "num_nextn_predict_layers": 1},
    # GLM-5: every layer full, top-k 4, no dense layer.
    "glm5_full_idx": {**_GLM5, "num_hidden_layers": 2, "q_lora_rank": 16, "n_routed_experts": 4,
                      "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
                      "first_k_dense_replace": 0, "routed_scaling_factor": 1.0, "index_topk": 4,
                      "indexer_types": ["full", "full"], "num_nextn_predict_layers": 0},
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


def write_hf_dir(name: str, out_dir: str | pathlib.Path, seed: int = 0, max_shard_size: str = "40KB",
                 **overrides: Any) -> pathlib.Path:
    """Save SHAPES[name] (with ``overrides`` of its hub config keys) as a sharded hub-style HF directory."""
    return write_hub_dir({**SHAPES[name], **overrides}, out_dir, seed, max_shard_size, fixture=name)


def write_hub_dir(hub: dict[str, Any], out_dir: str | pathlib.Path, seed: int = 0, max_shard_size: str = "40KB",
                  fixture: str = "custom") -> pathlib.Path:
    """Save a hub-style config's random model as a sharded HF directory; returns it."""
    name = fixture
    out = pathlib.Path(out_dir)
    model = build_model(hub, seed)
    model.save_pretrained(str(out), max_shard_size=max_shard_size)
    add_mtp_layers(out, hub, seed)
    (out / "config.json").write_text(json.dumps(hub, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512, "fixture": name}) + "\n")
    return out


def add_mtp_layers(out: pathlib.Path, hub: dict[str, Any], seed: int) -> None:
    """Random MTP-layer tensors (as the hub checkpoints store them) in one more shard; transformers skips them."""
    import torch
    from safetensors.torch import save_file

    h, first = hub["hidden_size"], hub["num_hidden_layers"]
    gen = torch.Generator().manual_seed(seed + 7)
    tensors = {}
    for i in range(hub.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{first + i}."
        shapes = {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
                  "shared_head.norm.weight": (h,), "input_layernorm.weight": (h,),
                  "self_attn.kv_a_layernorm.weight": (hub["kv_lora_rank"],)}
        tensors |= {p + k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    if not tensors:
        return
    save_file(tensors, str(out / "model-mtp-fixture.safetensors"), metadata={"format": "pt"})
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update(dict.fromkeys(tensors, "model-mtp-fixture.safetensors"))
    index_path.write_text(json.dumps(index, indent=2) + "\n")
