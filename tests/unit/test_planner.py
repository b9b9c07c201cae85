"""`sao-megatron plan`: parameter counts, layout checks, memory model, shipped configs."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import pytest

from sao_megatron.config import ExperimentConfig, ModelConfig, load_config
from sao_megatron.launch import planner as P

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODELS = ROOT / "configs" / "models"
EXPERIMENTS = ROOT / "configs" / "experiments"


def model(name: str) -> ModelConfig:
    return load_config(MODELS / f"{name}.yaml").model


def hf_tensor_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Reference: every tensor of the HF checkpoint (per-expert tensors, no MTP layer, no expert-bias
    buffer, which Megatron keeps as a buffer), written out from the HF naming."""
    h, d, v = m.hidden_size, m.kv_channels or m.hidden_size // m.num_attention_heads, m.vocab_size
    norm = (lambda n: {"weight": (n,), "bias": (n,)}) if m.normalization == "LayerNorm" else (
        lambda n: {"weight": (n,)})
    shapes = {"model.embed_tokens.weight": (v, h)}
    shapes |= {f"model.norm.{k}": s for k, s in norm(h).items()}
    if m.untie_embeddings_and_output_weights:
        shapes["lm_head.weight"] = (v, h)
    moe = P.moe_layer_mask(m)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm"):
            shapes |= {f"{p}{name}.{k}": s for k, s in norm(h).items()}
        for proj, rows in (("q", m.num_attention_heads * d), ("k", m.num_query_groups * d),
                           ("v", m.num_query_groups * d)):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (rows, h)
            if m.add_qkv_bias:
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
        shapes[f"{p}self_attn.o_proj.weight"] = (h, m.num_attention_heads * d)
        if m.qk_layernorm:
            for name in ("q_norm", "k_norm"):
                shapes |= {f"{p}self_attn.{name}.{k}": s for k, s in norm(d).items()}
        mlps = {}
        if moe[i]:
            shapes[f"{p}mlp.gate.weight"] = (m.num_moe_experts, h)
            mlps |= {f"experts.{e}": m.moe_ffn_hidden_size for e in range(m.num_moe_experts)}
            if m.moe_shared_expert_intermediate_size:
                mlps["shared_experts"] = m.moe_shared_expert_intermediate_size
        else:
            mlps[""] = m.ffn_hidden_size
        for prefix, f in mlps.items():
            q = f"{p}mlp.{prefix + '.' if prefix else ''}"
            shapes |= {f"{q}gate_proj.weight": (f, h), f"{q}up_proj.weight": (f, h),
                       f"{q}down_proj.weight": (h, f)}
    return shapes


def reference_total(m: ModelConfig) -> int:
    return sum(math.prod(s) for s in hf_tensor_shapes(m).values())


def reference_active(m: ModelConfig) -> int:
    """Total of the same model with only top-k experts, plus the full routers."""
    if m.num_moe_experts is None:
        return reference_total(m)
    only_k = dataclasses.replace(m, num_moe_experts=m.moe_router_topk)
    routers = sum(P.moe_layer_mask(m)) * (m.num_moe_experts - m.moe_router_topk) * m.hidden_size
    return reference_total(only_k) + routers


# ---------------------------------------------------------------- parameter counts


@pytest.mark.parametrize("name", ["tiny_moe", "qwen3-30b-a3b", "glm-355b-a32b", "glm-750b-a40b"])
def test_counts_match_the_hf_checkpoint_reference(name):
    m = model(name)
    counted = P.count_params(m, divisible_by=1)
    assert counted.total == reference_total(m)
    assert counted.active == reference_active(m)


@pytest.mark.parametrize("name, total, active", [
    ("qwen3-30b-a3b", 30.5e9, 3.3e9),     # Qwen3-30B-A3B model card: 30.5B total, 3.3B activated
    ("glm-355b-a32b", 355e9, 32e9),       # GLM-4.5: 355B / 32B (card counts the MTP layer)
    ("glm-750b-a40b", 750e9, 40e9),       # the GLM-scale target of this project
])
def test_counts_match_published_totals(name, total, active):
    counted = P.count_params(model(name), divisible_by=1)
    assert abs(counted.total - total) / total < 0.011, counted.total
    assert abs(counted.active - active) / active < 0.06, counted.active


def test_qwen3_30b_exact_counts():
    counted = P.count_params(model("qwen3-30b-a3b"))
    assert (counted.total, counted.active) == (30_532_122_624, 3_353_032_704)


def test_stage_shards_add_up_to_the_whole_model():
    m = model("glm-355b-a32b")
    for pp, ep in ((1, 1), (4, 32), (2, 160)):
        lay = P.Layout(nodes=pp * ep, gpus_per_node=1, tp=1, pp=pp, ep=ep, etp=1)
        stages = [P.stage_params(m, lay, s, critic=False) for s in range(pp)]
        summed = sum(sum(v for g, v in st.items() if g != "routed_experts") + st["routed_experts"] * ep
                     for st in stages)
        assert summed == P.count_params(m).total


def test_stage_layers_contiguous_and_interleaved():
    m = ModelConfig(num_layers=8)
    lay = P.Layout(nodes=1, gpus_per_node=4, tp=1, pp=2, ep=1, etp=1)
    assert P.stage_layers(m, lay, 1) == [4, 5, 6, 7]
    assert P.stage_layers(m, dataclasses.replace(lay, vpp=2), 1) == [2, 3, 6, 7]


def test_tp_sharding_and_vocab_padding():
    m = model("qwen3-30b-a3b")
    one = P.stage_params(m, P.SINGLE_GPU, 0, critic=False)
    tp4 = P.stage_params(m, P.Layout(nodes=1, gpus_per_node=8, tp=4, pp=1, ep=1, etp=1), 0, critic=False)
    assert tp4["embedding"] == 152064 // 4 * 2048 and P.padded_vocab_size(151936, 4) == 152064
    qk_norms = 48 * 2 * 128
    assert (tp4["attention"] - qk_norms) * 4 == one["attention"] - qk_norms
    assert tp4["routed_experts"] == one["routed_experts"] and tp4["norms"] == one["norms"]


def test_critic_swaps_lm_head_for_value_head():
    m = model("qwen3-30b-a3b")
    actor, critic = P.count_params(m), P.count_params(m, critic=True)
    assert critic.total == actor.total - actor.groups["lm_head"] + m.hidden_size + 1


# ---------------------------------------------------------------- memory model


def dense_cfg(**over) -> ExperimentConfig:
    m = ModelConfig(num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8, num_query_groups=8,
                    num_moe_experts=None, moe_ffn_hidden_size=None, vocab_size=1024, params_dtype="bf16")
    cfg = ExperimentConfig(model=m)
    return dataclasses.replace(cfg, **over)


def test_static_memory_matches_hand_count():
    cfg = dense_cfg()
    lay = P.Layout(nodes=1, gpus_per_node=8, tp=1, pp=1, ep=1, etp=1)
    n = P.count_params(cfg.model).total
    _, actor, critic = P.trainer_peak_gib(cfg, lay)
    assert actor.weights_gib * P.GIB == 2 * n and actor.grads_gib * P.GIB == 4 * n
    assert actor.optimizer_gib * P.GIB == pytest.approx(12 * n / 8)
    # critic default: only routed/shared experts + value head train -> here only the value head
    assert critic.trainable == 256 + 1 and critic.grads_gib * P.GIB == 4 * 257
    no_dist = P.Layout(nodes=1, gpus_per_node=8, tp=1, pp=1, ep=1, etp=1, distributed_optimizer=False)
    assert P.trainer_peak_gib(cfg, no_dist)[1].optimizer_gib * P.GIB == 12 * n


def test_activations_order_and_scaling():
    m = model("qwen3-30b-a3b")
    lay = P.Layout(nodes=1, gpus_per_node=8, tp=1, pp=1, ep=8, etp=1)
    per = {r: P._stage_activations(m, lay, 0, 4096, r) for r in ("none", "selective", "full")}
    assert per["full"] < per["selective"] < per["none"]
    assert P._stage_activations(m, lay, 0, 8192, "none") == 2 * per["none"]
    tp4 = dataclasses.replace(lay, tp=4)
    assert P._stage_activations(m, tp4, 0, 4096, "none") == pytest.approx(per["none"] / 4)
    pp2 = dataclasses.replace(lay, pp=2)  # stage 0 keeps 2 micro-batches of half the layers in flight
    assert P._stage_activations(m, pp2, 0, 4096, "none") == pytest.approx(per["none"])
    assert P._stage_activations(m, pp2, 1, 4096, "none") == pytest.approx(per["none"] / 2)


def test_offload_and_more_nodes_lower_the_peak():
    cfg = load_config(EXPERIMENTS / "sao-math-qwen3-30b-a3b.yaml")
    lay = P.layout_from_config(cfg.parallel, cfg.resources)
    base = P.trainer_peak_gib(cfg, lay)[0]
    off = dataclasses.replace(cfg, resources=dataclasses.replace(cfg.resources, offload_idle_optimizer=True))
    assert P.trainer_peak_gib(off, lay)[0] < base
    assert P.trainer_peak_gib(cfg, dataclasses.replace(lay, nodes=8))[0] < base
    no_critic = dataclasses.replace(cfg, critic=dataclasses.replace(cfg.critic, enabled=False))
    assert P.trainer_peak_gib(no_critic, lay)[0] < base


def test_rollout_weights_and_kv_cache():
    m = model("qwen3-30b-a3b")
    assert P.rollout_params_per_gpu(m, 1) == P.count_params(m, divisible_by=1).total
    assert P.kv_bytes_per_token(m, 1) == 2 * 48 * 4 * 128 * 2
    assert P.kv_bytes_per_token(m, 4) == P.kv_bytes_per_token(m, 8) == 2 * 48 * 1 * 128 * 2  # replicated KV
    assert P.rollout_params_per_gpu(m, 8) > P.count_params(m, divisible_by=1).total / 8


def test_weight_sync_estimate():
    cfg = load_config(EXPERIMENTS / "sao-math-qwen3-30b-a3b.yaml")
    ws = P.make_plan(cfg, suggest=False).weight_sync
    assert ws["bytes"] == 2 * reference_total(cfg.model)
    assert ws["nccl_s"] == pytest.approx(ws["bytes"] / 40e9)
    assert ws["disk_s"] == pytest.approx(2 * ws["bytes"] / 5e9)


# ---------------------------------------------------------------- shipped configs


def planned_configs() -> list[pathlib.Path]:
    """Every experiment, layout and recipe (configs/models/ only describe architectures: no layout)."""
    return sorted(EXPERIMENTS.rglob("*.yaml"))


def test_experiments_cover_scales_and_gpus():
    names = {p.name for p in planned_configs() if p.parent == EXPERIMENTS}
    for scale in ("qwen3-30b-a3b", "glm-355b-a32b", "glm-750b-a40b"):
        for gpu in ("", "-h200"):
            assert f"sao-math-{scale}{gpu}.yaml" in names and f"grpo-math-{scale}{gpu}.yaml" in names
    assert {"sao-code-qwen3-30b-a3b.yaml", "grpo-dis-math-128x8-qwen3-30b-a3b.yaml",
            "sao-math-16x8-qwen3-30b-a3b.yaml"} <= names


@pytest.mark.parametrize("path", planned_configs(), ids=lambda p: p.relative_to(EXPERIMENTS).as_posix())
def test_every_experiment_fits_at_its_stated_node_count(path):
    cfg = load_config(path)
    plan = P.make_plan(cfg, suggest=False)
    assert plan.errors == [] and plan.fits, (plan.errors, plan.trainer_peak_gib, plan.rollout)
    if cfg.rollout.engine == "sglang":
        assert plan.rollout is not None and plan.rollout.fits


def test_paper_settings_in_experiments():
    sao = load_config(EXPERIMENTS / "sao-math-qwen3-30b-a3b.yaml")
    assert (sao.scheduler.mode, sao.scheduler.batch_size, sao.algorithm.dis.eps_low, sao.algorithm.dis.eps_high) == (
        "single", 128, 0.3, 5.0)
    assert sao.critic.num_updates_per_step == 2 and "attention" not in sao.critic.trainable
    code = load_config(EXPERIMENTS / "sao-code-qwen3-30b-a3b-h200.yaml")
    assert (code.algorithm.dis.eps_low, code.algorithm.dis.eps_high, code.resources.gpu_mem_gb) == (0.8, 3.0, 141)
    grpo = load_config(EXPERIMENTS / "grpo-math-qwen3-30b-a3b.yaml")
    assert (grpo.algorithm.name, grpo.algorithm.group_size, grpo.scheduler.batch_size) == ("grpo", 8, 128)
    control = load_config(EXPERIMENTS / "grpo-dis-math-128x8-qwen3-30b-a3b.yaml")
    assert control.scheduler.batch_size // control.algorithm.group_size == sao.scheduler.batch_size


# ---------------------------------------------------------------- errors, suggestion, CLI


def test_impossible_layouts_give_clear_errors():
    cfg = load_config(EXPERIMENTS / "sao-math-qwen3-30b-a3b.yaml", ["parallel.expert_model_parallel_size=3"],
                      check=False)
    errors = P.make_plan(cfg, suggest=False).errors
    assert any("num_moe_experts=128 is not divisible by parallel.expert_model_parallel_size=3" in e
               and "pick EP from [1, 2, 4, 8, 16, 32, 64, 128]" in e for e in errors), errors
    cfg = load_config(EXPERIMENTS / "sao-math-glm-355b-a32b.yaml", ["parallel.tensor_model_parallel_size=16",
                                                                    "parallel.expert_tensor_parallel_size=1"],
                      check=False)
    errors = P.make_plan(cfg, suggest=False).errors
    assert any("tensor_model_parallel_size=16 does not fit in one node of 8 GPUs" in e
               and "use a divisor of 8" in e for e in errors), errors


def test_too_small_micro_batch_and_too_many_dp_ranks():
    cfg = load_config(EXPERIMENTS / "sao-math-qwen3-30b-a3b.yaml", ["actor.max_tokens_per_microbatch=8192",
                                                                    "scheduler.batch_size=4"])
    errors = P.make_plan(cfg, suggest=False).errors
    assert any("actor.max_tokens_per_microbatch=8192 < data.max_total_tokens=16384" in e for e in errors)
    assert any("scheduler.batch_size=4 < data-parallel size 8" in e for e in errors)


def test_rollout_errors():
    cfg = load_config(EXPERIMENTS / "sao-math-qwen3-30b-a3b.yaml", ["resources.rollout_tp_size=8",
                                                                    "resources.rollout_ep_size=8",
                                                                    "resources.rollout_nodes=0"])
    errors = P.make_plan(cfg, suggest=False).errors
    assert any("set resources.rollout_nodes >= 1" in e for e in errors)
    cfg = load_config(EXPERIMENTS / "sao-math-glm-355b-a32b.yaml", ["resources.rollout_tp_size=64",
                                                                    "resources.rollout_nodes=8"])
    assert any("does not divide model.num_attention_heads=96" in e for e in P.make_plan(cfg, suggest=False).errors)


def brute_force_fits(cfg: ExperimentConfig, nodes: int) -> bool:
    gpn, m = cfg.resources.gpus_per_node, cfg.model
    for tp in (1, 2, 4, 8):
        for pp in range(1, m.num_layers + 1):
            for ep in range(1, m.num_moe_experts + 1):
                for etp in {1, tp}:
                    lay = P.Layout(nodes=nodes, gpus_per_node=gpn, tp=tp, pp=pp, ep=ep, etp=etp)
                    if lay.world % (tp * pp) or lay.world % (ep * etp * pp) or P.check_layout(cfg, lay):
                        continue
                    if P.trainer_peak_gib(cfg, lay)[0] <= P.USABLE_FRACTION * cfg.resources.gpu_mem_gb:
                        return True
    return False


def test_suggestion_is_the_smallest_layout_that_fits():
    cfg = load_config(EXPERIMENTS / "sao-math-qwen3-30b-a3b.yaml", ["resources.nodes=1"])
    plan = P.make_plan(cfg)
    assert not plan.fits and plan.suggestion is not None
    fixed = P.make_plan(P.apply_layout(cfg, plan.suggestion), suggest=False)
    assert fixed.fits and fixed.errors == []
    assert not brute_force_fits(cfg, plan.suggestion.nodes - 1)


def test_suggested_rollout_server_fits():
    cfg = load_config(EXPERIMENTS / "sao-math-glm-355b-a32b.yaml", ["resources.rollout_tp_size=8",
                                                                    "resources.rollout_ep_size=8"])
    plan = P.make_plan(cfg, suggest=False)
    assert plan.rollout is not None and not plan.rollout.fits  # 706 GB of weights do not fit one H100 node
    tp = P.suggest_rollout_tp(cfg, cfg.resources)
    assert tp == 16
    assert P.rollout_memory(cfg, dataclasses.replace(cfg.resources, rollout_tp_size=tp)).fits


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    from sao_megatron.cli import main

    code = main(["plan", *argv])
    return code, capsys.readouterr().out


def test_cli_json(capsys):
    code, out = run_cli(capsys, "--config", str(EXPERIMENTS / "sao-math-qwen3-30b-a3b.yaml"), "--json",
                        "--max-nodes", "4")
    data = json.loads(out)
    assert code == 0 and data["fits"] is True
    assert data["total_params"] == 30_532_122_624 and data["active_params"] == 3_353_032_704
    gib = data["per_gpu_gib"]
    assert set(gib) >= {"actor", "critic", "rollout", "trainer_peak"} and gib["trainer_peak"] < 72
    assert data["layout"]["world"] == 32 and data["suggestion"]["nodes"] <= 4


def test_cli_cluster_flags_and_exit_code(capsys):
    path = str(EXPERIMENTS / "sao-math-qwen3-30b-a3b.yaml")
    code, out = run_cli(capsys, "--config", path, "--json", "--nodes", "1", "--max-nodes", "2")
    data = json.loads(out)
    assert code == 1 and data["fits"] is False and data["layout"]["nodes"] == 1
    assert any("does not divide" in e or "not divisible" in e for e in data["errors"])  # EP32 on 8 GPUs
    code, out = run_cli(capsys, "--config", path, "--json", "--gpu-mem-gb", "141", "--max-nodes", "2")
    assert code == 0 and json.loads(out)["per_gpu_gib"]["trainer_budget"] == pytest.approx(0.9 * 141)


def test_cli_table(capsys):
    code, out = run_cli(capsys, "--config", str(EXPERIMENTS / "sao-math-glm-750b-a40b.yaml"), "--max-nodes", "1")
    assert code == 0
    for fragment in ("743.07B parameters", "40.94B active", "trainer peak", "rollout (8 x TP32)", "weight sync",
                     "fits"):
        assert fragment in out
