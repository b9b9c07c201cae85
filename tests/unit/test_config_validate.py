"""Cross-field validation: each violated constraint gives a message naming the keys and the fix."""

from __future__ import annotations

import pytest

from sao_megatron.config import ConfigError, ExperimentConfig, from_dict, validate

pytestmark = pytest.mark.unit

MOE = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": 4,
       "num_moe_experts": 8, "moe_ffn_hidden_size": 32, "moe_router_topk": 2, "vocab_size": 128}


def make(**sections) -> ExperimentConfig:
    tree = {"model": dict(MOE)}
    for name, values in sections.items():
        tree.setdefault(name, {}).update(values)
    return from_dict(ExperimentConfig, tree)


def message(cfg: ExperimentConfig, world_size: int | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size=world_size, source="exp.yaml")
    text = str(info.value)
    assert text.startswith("exp.yaml: ")
    return text


def test_valid_base_config_passes():
    validate(make(), world_size=8)
    validate(make(parallel={"tensor_model_parallel_size": 2, "sequence_parallel": True,
                            "expert_model_parallel_size": 4, "pipeline_model_parallel_size": 2}), world_size=16)


@pytest.mark.parametrize("sections, must_contain", [
    ({"parallel": {"tensor_model_parallel_size": 3, "sequence_parallel": True}},
     ["model.num_attention_heads=8 is not divisible by parallel.tensor_model_parallel_size=3", "choose TP"]),
    ({"parallel": {"tensor_model_parallel_size": 8, "sequence_parallel": True}},
     ["model.num_query_groups=4 is not divisible by parallel.tensor_model_parallel_size=8"]),
    ({"parallel": {"expert_model_parallel_size": 3}},
     ["model.num_moe_experts=8 is not divisible by parallel.expert_model_parallel_size=3",
      "pick EP from [1, 2, 4, 8]"]),
    ({"parallel": {"pipeline_model_parallel_size": 3}},
     ["model.num_layers=4 is not divisible by parallel.pipeline_model_parallel_size=3"]),
    ({"parallel": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 4}},
     ["model.num_layers=4 is not divisible by PP*VPP=8"]),
    ({"parallel": {"tensor_model_parallel_size": 2}},
     ["MoE with parallel.tensor_model_parallel_size > 1 requires parallel.sequence_parallel=true",
      "--set parallel.sequence_parallel=true"]),
    ({"parallel": {"context_parallel_size": 2}}, ["parallel.context_parallel_size > 1 is not supported"]),
    ({"parallel": {"tensor_model_parallel_size": 0}}, ["parallel sizes must all be >= 1"]),
    ({"model": {"num_query_groups": 3}}, ["model.num_attention_heads=8 must be a multiple of "
                                          "model.num_query_groups=3"]),
    ({"model": {"moe_router_topk": 9}}, ["model.moe_router_topk=9 exceeds model.num_moe_experts=8"]),
    ({"model": {"moe_ffn_hidden_size": None}}, ["model.moe_ffn_hidden_size must be set"]),
    ({"model": {"moe_router_topk": 1}}, ["model.moe_router_topk=1 with the softmax router needs "
                                         "model.moe_router_pre_softmax=true"]),
    ({"model": {"moe_layer_freq": [1, 1]}}, ["model.moe_layer_freq as a list needs num_layers=4 entries"]),
    ({"model": {"moe_layer_freq": [1, 2, 1, 1]}}, ["entries of 0/1"]),
    ({"model": {"rotary_percent": 0.0}}, ["model.rotary_percent=0.0 must be in (0, 1]"]),
    ({"model": {"num_query_groups": 0}}, ["model.num_query_groups=0 must be >= 1"]),
    ({"model": {"num_moe_experts": 0}}, ["model.num_moe_experts=0 must be >= 1 (or null)"]),
    ({"model": {"num_moe_experts": None}, "parallel": {"expert_model_parallel_size": 2}},
     ["parallel.expert_model_parallel_size > 1 needs an MoE model"]),
    ({"critic": {"num_updates_per_step": 0}}, ["critic.num_updates_per_step=0 must be >= 1 (paper: K=2)"]),
    ({"critic": {"enabled": False}}, ["algorithm.name=sao needs a value model: set critic.enabled=true"]),
    ({"algorithm": {"name": "ppo"}, "critic": {"enabled": False}}, ["algorithm.name=ppo needs a value model"]),
    ({"algorithm": {"name": "grpo"}, "scheduler": {"mode": "single"}},
     ["algorithm.name=grpo needs groups: set scheduler.mode=group"]),
    ({"algorithm": {"name": "grpo_dis", "group_size": 1}, "scheduler": {"mode": "group"}},
     ["algorithm.group_size=1 must be >= 2 for grpo_dis"]),
    ({"algorithm": {"name": "grpo", "group_size": 8}, "scheduler": {"mode": "group", "batch_size": 100}},
     ["scheduler.batch_size=100 must be a multiple of algorithm.group_size=8"]),
    ({"algorithm": {"dis": {"eps_low": 1.5}}}, ["algorithm.dis.eps_low=1.5 must be in (0, 1]"]),
    ({"algorithm": {"dis": {"eps_high": 0.0}}}, ["algorithm.dis.eps_high=0.0 must be > 0"]),
    ({"algorithm": {"name": "ppo", "ppo_clip": {"dual_clip": 1.0}}}, ["algorithm.ppo_clip.dual_clip=1.0 must be > 1"]),
    ({"algorithm": {"name": "ppo", "ppo_clip": {"clip_low": 1.2}}},
     ["algorithm.ppo_clip.clip_low=1.2 must be in [0, 1]"]),
    ({"algorithm": {"gae": {"gamma": 1.5}}}, ["algorithm.gae.gamma and algorithm.gae.lam must be in [0, 1]"]),
    ({"algorithm": {"name": "sao_running_mean", "running_mean": {"momentum": 1.0}}, "critic": {"enabled": False}},
     ["algorithm.running_mean.momentum=1.0 must be in [0, 1)"]),
    ({"algorithm": {"name": "ppo", "dis": {"eps_low": 0.8}}},
     ["algorithm.dis.eps_low=0.8 is set, but algorithm.name=ppo does not read algorithm.dis (read by sao, grpo_dis, "
      "sao_running_mean): set it back to 0.3 (or remove it), or choose one of those objectives"]),
    ({"algorithm": {"name": "sao", "group_size": 4}},
     ["algorithm.group_size=4 is set, but samples come one per prompt", "set scheduler.mode=group"]),
    ({"algorithm": {"name": "sao", "group_size": 8}, "scheduler": {"mode": "group", "batch_size": 100}},
     ["scheduler.batch_size=100 must be a multiple of algorithm.group_size=8"]),
    ({"scheduler": {"max_staleness": -1}}, ["scheduler.max_staleness must be >= 0"]),
    ({"scheduler": {"concurrency": 0}}, ["scheduler.batch_size and scheduler.concurrency must be >= 1"]),
    ({"data": {"max_total_tokens": 1024}},
     ["data.max_total_tokens=1024 exceeds model.max_position_embeddings=512"]),
    ({"data": {"max_prompt_tokens": 256, "max_total_tokens": 256}}, ["data.max_prompt_tokens=256 leaves no room"]),
    ({"resources": {"rollout_tp_size": 4, "rollout_ep_size": 3}},
     ["resources.rollout_ep_size=3 must divide resources.rollout_tp_size=4"]),
    ({"resources": {"rollout_tp_size": 12}}, ["resources.rollout_tp_size=12 must divide gpus_per_node=8"]),
    ({"resources": {"rollout_tp_size": 16, "rollout_nodes": 3}},
     ["resources.rollout_nodes=3 x 8 GPUs do not split", "multiple of 2 rollout nodes"]),
    ({"resources": {"rollout_mem_fraction": 1.5}}, ["resources.rollout_mem_fraction in (0, 1]"]),
    ({"resources": {"nodes": 0}}, ["resources.nodes=0 must be >= 1"]),
    ({"resources": {"offload_idle_optimizer": True}},
     ["resources.offload_idle_optimizer needs model.params_dtype bf16 or fp16"]),
])
def test_violations_name_keys_and_fix(sections, must_contain):
    text = message(make(**sections))
    for fragment in must_contain:
        assert fragment in text, text


@pytest.mark.parametrize("parallel, world_size, expect", [
    ({"tensor_model_parallel_size": 2, "sequence_parallel": True, "pipeline_model_parallel_size": 2}, 6,
     "world size 6 is not divisible by TP*PP*CP=4"),
    ({"expert_model_parallel_size": 8, "pipeline_model_parallel_size": 2}, 4,
     "world size 4 is not divisible by expert-TP*EP*PP=16"),
])
def test_world_size_checks(parallel, world_size, expect):
    cfg = make(parallel=parallel)
    validate(cfg)  # layout-internal constraints hold; only the world size is wrong
    assert expect in message(cfg, world_size)


def test_all_violations_are_reported_together():
    text = message(make(parallel={"tensor_model_parallel_size": 3, "expert_model_parallel_size": 3},
                        critic={"num_updates_per_step": 0}))
    for fragment in ["num_attention_heads=8", "num_moe_experts=8", "sequence_parallel", "num_updates_per_step"]:
        assert fragment in text


def test_group_mode_is_allowed_for_critic_algorithms():
    # SAO at 16 prompts x 8 rollouts is the equal-diversity control (DESIGN section 1).
    validate(make(algorithm={"name": "sao", "group_size": 8}, scheduler={"mode": "group"}))


def test_dense_model_validates_without_expert_checks():
    validate(make(model={"num_moe_experts": None, "moe_ffn_hidden_size": None},
                  parallel={"tensor_model_parallel_size": 2}))


def test_load_config_validates_and_check_false_skips(tmp_path):
    from sao_megatron.config import load_config

    f = tmp_path / "e.yaml"
    f.write_text("parallel: {expert_model_parallel_size: 3}\n")
    with pytest.raises(ConfigError, match="not divisible by parallel.expert_model_parallel_size=3"):
        load_config(f)
    assert load_config(f, check=False).parallel.expert_model_parallel_size == 3
    with pytest.raises(ConfigError, match=r"world size 5 is not divisible by TP\*PP\*CP=2"):
        load_config(tmp_path / "e.yaml", ["parallel.expert_model_parallel_size=1",
                                          "parallel.pipeline_model_parallel_size=2"], world_size=5)


def test_auto_scheduler_mode_follows_the_algorithm():
    from sao_megatron.config import ExperimentConfig, from_dict
    from sao_megatron.config.validate import resolved_mode, validate

    for name, want in (("sao", "single"), ("ppo", "single"), ("sao_running_mean", "single"),
                       ("grpo", "group"), ("grpo_dis", "group")):
        cfg = from_dict(ExperimentConfig, {"algorithm": {"name": name}})
        assert cfg.scheduler.mode == "auto" and resolved_mode(cfg) == want
        validate(cfg)
    explicit = from_dict(ExperimentConfig, {"algorithm": {"name": "grpo"}, "scheduler": {"mode": "sync"}})
    assert resolved_mode(explicit) == "sync"


# Which objectives read which algorithm section, written out by hand (not derived from the table under test).
READERS = {"gae": {"sao", "ppo"}, "group": {"grpo", "grpo_dis"}, "running_mean": {"sao_running_mean"},
           "dis": {"sao", "grpo_dis", "sao_running_mean"}, "ppo_clip": {"ppo", "grpo"}}
CHANGED = {"gae": {"lam": 0.9}, "group": {"normalize_std": False}, "running_mean": {"momentum": None},
           "dis": {"eps_high": 3.0}, "ppo_clip": {"dual_clip": 3.0}}


@pytest.mark.parametrize("name", ["sao", "ppo", "grpo", "grpo_dis", "sao_running_mean"])
@pytest.mark.parametrize("section", sorted(READERS))
def test_a_knob_is_refused_where_the_objective_does_not_read_it(name, section):
    """A setting accepted but doing nothing is a defect: a changed knob of a section the chosen objective does
    not read is refused, naming the key, and accepted where the objective reads it."""
    cfg = make(algorithm={"name": name, section: CHANGED[section]}, critic={"enabled": name in {"sao", "ppo"}})
    key = f"algorithm.{section}.{next(iter(CHANGED[section]))}="
    if name in READERS[section]:
        validate(cfg)
    else:
        text = message(cfg)
        assert key in text and f"algorithm.name={name} does not read algorithm.{section}" in text, text


def test_a_knob_at_its_default_is_not_refused():
    validate(make(algorithm={"name": "grpo", "dis": {"eps_low": 0.3, "eps_high": 5.0}}, critic={"enabled": False}))
