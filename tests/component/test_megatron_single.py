"""Single-process Megatron checks: what the builder builds, log-prob/value alignment, critic groups.

The Megatron part runs once in a subprocess (mp_scripts/megatron_single.py); pure helpers are
tested here directly. The `models smoke` command runs as a real CLI process.
"""

from __future__ import annotations

import math
import pathlib

import pytest
import torch
import torch.nn.functional as F
from megatron_launch import launch, run_json

from sao_megatron.config.schema import ModelConfig, ParallelConfig

pytestmark = pytest.mark.component


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_json("megatron_single.py", tmp_path_factory.mktemp("megatron_single"), timeout=600, light_main=True)


# ------------------------------------------------------------------ builder: what was built


def test_glm_options_reach_the_modules(single):
    arch = single["architecture"]
    assert arch["layer_mlp_types"] == ["MLP", "MoELayer", "MoELayer"]  # moe_layer_freq [0, 1, 1]
    assert arch["router_score_function"] == "sigmoid"
    assert arch["router_topk_scaling_factor"] == 2.5
    assert arch["has_expert_bias"] and arch["has_shared_experts"]
    assert arch["qkv_bias_shape"] == [64]  # (4 q heads + 2*2 kv heads) * kv_channels 8
    assert arch["qkv_weight_shape"] == [64, 32]
    assert arch["q_layernorm"] == "RMSNorm" and arch["input_norm"] == "RMSNorm"
    assert arch["num_experts"] == 4
    assert arch["dropout"] == [0.0, 0.0]


def test_partial_rope_uses_rotary_percent_and_base(single):
    arch = single["architecture"]
    assert arch["rotary_dim"] == 4  # kv_channels 8 * rotary_percent 0.5
    assert math.isclose(arch["rotary_inv_freq0"], 5000 ** (-2 / 4), rel_tol=1e-6)


def test_vocab_is_padded_for_tp_and_logprobs_ignore_the_padding(single):
    assert single["architecture"]["embedding_rows"] == single["architecture"]["padded_vocab"] == 128
    assert single["logits_shape"] == [2, 12, 128]
    # The padding columns were set to a large logit before comparing to a reference over 100 columns.
    assert single["logprob_vs_reference"] < 1e-5
    assert single["entropy_vs_reference"] < 1e-5
    assert single["logprob_col0"] == 0.0


def test_compute_logprobs_matches_a_direct_forward(single):
    assert single["compute_logprobs_shapes"] == [[2, 12], [2, 9]]
    assert single["compute_logprobs_vs_direct"] < 1e-5


def test_recompute_granularity_reaches_megatron_and_keeps_gradients(single):
    """actor/critic.recompute_granularity: full re-runs every layer in backward, selective only core
    attention (local spec), none nothing; gradients equal the no-recompute ones."""
    assert single["recompute_none_config"][:3] == [None, None, None]
    assert single["recompute_full_config"][:3] == ["full", "uniform", 1]
    # Local spec: Megatron recomputes norms only with TE and the MoE activation only with grouped GEMM.
    assert single["recompute_selective_config"] == ["selective", None, None, ["core_attn"]]
    assert single["recompute_none_calls"] == {"layer": 1, "core_attn": 1, "input_norm": 1, "experts": 1}
    assert single["recompute_full_calls"] == {"layer": 2, "core_attn": 2, "input_norm": 2, "experts": 2}
    assert single["recompute_selective_calls"] == {"layer": 1, "core_attn": 2, "input_norm": 1, "experts": 1}
    assert single["recompute_num_grads"] > 10
    assert single["recompute_full_grad_diff"] < 1e-6
    assert single["recompute_selective_grad_diff"] < 1e-6


def test_offload_idle_optimizer_frees_grad_buffers_and_keeps_training_identical(single):
    """Parked (outside ``resident``) the gradient buffers hold no memory; inside they are back; three
    bf16 steps with offloading give exactly the losses and weights of three steps without."""
    parked, inside = single["offload_bytes"]["True"]
    assert parked == [0, 0, 0] and min(inside) > 0
    assert single["offload_bytes"]["False"] == [inside, inside]
    assert single["offload_losses"][0] == single["offload_losses"][1]
    assert single["offload_param_diff"] == 0.0 and single["offload_params_changed"] > 0


def test_recompute_fields_reject_unknown_granularity():
    from sao_megatron.models.builder import recompute_fields

    with pytest.raises(ValueError, match="recompute_granularity"):
        recompute_fields("partial")
    # With Transformer Engine (GPU) the norms and the grouped-GEMM MoE activation are recomputed too.
    assert recompute_fields("selective", use_te=True, grouped_gemm=True)["recompute_modules"] == [
        "core_attn", "layernorm", "moe_act"]


def test_padded_vocab_size():
    from sao_megatron.models.builder import padded_vocab_size

    assert padded_vocab_size(100, 1) == 128
    assert padded_vocab_size(128, 1) == 128
    assert padded_vocab_size(100, 2) == 256
    assert padded_vocab_size(151936, 2) == 152064  # Qwen3 vocab at TP2


def test_transformer_config_copies_megatron_named_fields():
    from sao_megatron.models.builder import build_transformer_config

    model = ModelConfig(num_layers=4, moe_layer_freq=[0, 1, 1, 1], moe_router_score_function="sigmoid",
                        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
                        add_qkv_bias=True, layernorm_epsilon=1e-5)
    parallel = ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True,
                              pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    cfg = build_transformer_config(model, parallel, use_te=False)
    assert (cfg.moe_layer_freq, cfg.moe_router_score_function, cfg.moe_router_topk_scaling_factor) == (
        [0, 1, 1, 1], "sigmoid", 2.5)
    assert cfg.moe_router_enable_expert_bias and cfg.add_qkv_bias and cfg.qk_layernorm
    assert cfg.moe_router_bias_update_rate == 0.0  # the engines serve the same fixed bias
    assert (cfg.tensor_model_parallel_size, cfg.expert_model_parallel_size, cfg.sequence_parallel) == (2, 2, True)
    assert cfg.layernorm_epsilon == 1e-5 and cfg.calculate_per_token_loss
    assert not cfg.variable_seq_lengths  # interleaved PP: micro-batches are padded to one shape instead


# ------------------------------------------------------------------ actor / critic maths (no distribution)


def _loop_reference(logits, tokens, vocab):
    b, s, _ = logits.shape
    lp, ent = torch.zeros(b, s), torch.zeros(b, s)
    for t in range(1, s):
        logp = F.log_softmax(logits[:, t - 1, :vocab].double(), -1)
        lp[:, t] = logp.gather(-1, tokens[:, t:t + 1]).squeeze(-1).float()
        ent[:, t] = -(logp.exp() * logp).sum(-1).float()
    return lp, ent


def test_token_logprobs_alignment_padding_temperature_and_gradient():
    from sao_megatron.models.actor import token_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 16, generator=g, requires_grad=True)
    tokens = torch.randint(0, 13, (3, 7), generator=g)
    lp, ent = token_logprobs(logits, tokens, tp_group=None, vocab_size=13, temperature=0.7)
    ref_lp, ref_ent = _loop_reference(logits.detach() / 0.7, tokens, 13)
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    lp.sum().backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    ref = F.log_softmax(ref_logits[:, :-1, :13] / 0.7, -1).gather(-1, tokens[:, 1:, None]).sum()
    ref.backward()
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-5)  # padding columns get zero gradient


def test_token_values_read_the_position_that_predicts_the_token():
    from sao_megatron.models.critic import token_values

    raw = torch.arange(10.0).reshape(2, 5, 1)
    assert token_values(raw).tolist() == [[0, 0, 1, 2, 3], [0, 5, 6, 7, 8]]


def test_values_and_critic_from_actor_checkpoint(single):
    assert single["critic_trunk_equals_actor"] and single["value_head_zero"]
    assert single["value_raw_shape"] == [2, 12, 1] and single["values_shape"] == [2, 12]
    assert single["values_alignment_err"] == 0.0 and single["values_col0"] == 0.0


# ------------------------------------------------------------------ critic parameter groups


def test_every_parameter_has_the_expected_group(single):
    groups = single["param_groups"]
    expect = {"embedding.word_embeddings.weight": "embedding", "decoder.final_layernorm.weight": "norms",
              "decoder.layers.0.input_layernorm.weight": "norms", "decoder.layers.0.pre_mlp_layernorm.weight": "norms",
              "decoder.layers.0.mlp.linear_fc1.weight": "dense_mlp", "decoder.layers.1.mlp.router.weight": "router",
              "decoder.layers.1.self_attention.linear_qkv.bias": "attention",
              "decoder.layers.1.self_attention.q_layernorm.weight": "attention",
              "decoder.layers.1.self_attention.linear_proj.weight": "attention",
              "decoder.layers.2.mlp.shared_experts.linear_fc2.weight": "shared_experts",
              "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight": "routed_experts",
              "output_layer.weight": "value_head", "output_layer.bias": "value_head"}
    assert {k: groups[k] for k in expect} == expect
    assert set(groups.values()) <= set(single["known_groups"])


def test_default_critic_trains_experts_and_head_only(single):
    trainable = {n for n, on in single["requires_grad"].items() if on}
    assert trainable == {n for n, g in single["param_groups"].items()
                         if g in ("routed_experts", "shared_experts", "value_head")}
    counts = single["freeze_counts"]
    assert counts["trainable"] + counts["frozen"] == single["numel_total"]
    assert counts["trainable"] == counts["routed_experts"] + counts["shared_experts"] + counts["value_head"]
    # Frozen parameters get no DDP gradient buffer (hence no optimizer state).
    assert set(single["ddp_grad_params"]) == trainable


def test_param_group_naming_for_te_and_wrapped_names():
    from sao_megatron.models.critic import param_group

    assert param_group("module.decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == "norms"
    assert param_group("module.decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == "norms"
    assert param_group("decoder.layers.1.mlp.experts.linear_fc1.weight0") == "routed_experts"  # TE grouped GEMM
    assert param_group("output_layer.weight") == "lm_head"
    with pytest.raises(ValueError, match="matches no critic parameter group"):
        param_group("decoder.layers.0.mystery.weight")


def test_unknown_trainable_group_is_rejected_with_the_valid_names():
    from sao_megatron.models.critic import freeze_for_critic

    with pytest.raises(ValueError, match="unknown group.*'experts'.*routed_experts"):
        freeze_for_critic([torch.nn.Linear(2, 2)], ["experts"])


def test_plain_backward_runs_under_the_cpu_device_mode(single):
    assert single["direct_backward_grad_norm"] > 0


def test_shims_are_idempotent_and_map_cuda_to_cpu(single):
    assert single["mode_depth_after_two_applies"] == [1, 1]
    assert single["tensor_type_reported"] == "torch.cuda.FloatTensor"
    assert single["cuda_alloc_maps_to"] == "cpu"


# ------------------------------------------------------------------ CLI


def test_models_smoke_cli_prints_counts_and_losses(tmp_path):
    proc = launch(["sao_megatron.cli", "models", "smoke", "--config", "configs/models/tiny_moe.yaml", "--set",
                   "actor.optimizer.lr=1e-3", "--steps", "2"], module=True, timeout=600,
                  cwd=pathlib.Path(__file__).resolve().parents[2])  # python -m sao_megatron.cli ...
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in proc.stdout.splitlines() if line.startswith("│")}
    assert set(rows) == {"actor", "critic"}
    total, trainable, frozen = (int(x.replace(",", "")) for x in rows["critic"][:3])
    assert total == trainable + frozen and frozen > 0 and trainable > 0
    assert int(rows["actor"][2].replace(",", "")) == 0  # the actor trains everything
    first, last = (float(x) for x in rows["actor"][3].split("→"))
    assert last < first
