"""Cross-field checks with actionable messages.

Field types are checked by the loader; here live the constraints between
fields (divisibility, topology, algorithm/critic consistency). ``world_size``
is optional: without it only layout-internal constraints are checked.
"""

from __future__ import annotations

import dataclasses

from sao_megatron.algorithms.objectives import OBJECTIVES, objective, users_of
from sao_megatron.config.loader import ConfigError
from sao_megatron.config.schema import AlgorithmConfig, ExperimentConfig, ModelConfig, ParallelConfig, ResourcesConfig


def validate(cfg: ExperimentConfig, *, world_size: int | None = None, source: str = "config") -> None:
    """Raise ConfigError naming the key and the fix for the first violated constraint."""
    errors = (check_model(cfg.model) + check_parallel(cfg.model, cfg.parallel, world_size)
              + check_training(cfg) + check_resources(cfg.resources) + check_weight_sync_format(cfg))
    if errors:
        raise ConfigError(f"{source}: " + "\n  ".join(errors))


def check_weight_sync_format(cfg: ExperimentConfig) -> list[str]:
    """fp8_block is for SGLang engines serving a block-FP8 checkpoint of an MLA model."""
    if cfg.rollout.weight_sync.format != "fp8_block":
        return []
    if cfg.rollout.engine == "embedded":
        return ["rollout.weight_sync.format=fp8_block needs rollout.engine=sglang (the embedded engine serves "
                "unquantized weights): use rollout.weight_sync.format=unquantized"]
    if not cfg.model.multi_latent_attention:
        return [f"rollout.weight_sync.format=fp8_block is the block-FP8 scheme of DeepSeek-V3 / GLM-5 checkpoints; "
                f"model.family={cfg.model.family} has none: use rollout.weight_sync.format=unquantized"]
    return []


_POSITIVE_MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                          "num_query_groups", "moe_router_topk", "vocab_size", "max_position_embeddings")


def check_model(m: ModelConfig) -> list[str]:
    errs = [f"model.{name}={getattr(m, name)} must be >= 1" for name in _POSITIVE_MODEL_FIELDS
            if getattr(m, name) < 1]
    for name in ("kv_channels", "num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        if getattr(m, name) is not None and getattr(m, name) < 1:
            errs.append(f"model.{name}={getattr(m, name)} must be >= 1 (or null)")
    if errs:  # the divisibility checks below would divide by zero
        return errs
    if m.num_attention_heads % m.num_query_groups:
        errs.append(f"model.num_attention_heads={m.num_attention_heads} must be a multiple of "
                    f"model.num_query_groups={m.num_query_groups}")
    if m.num_moe_experts is not None:
        if m.moe_router_topk > m.num_moe_experts:
            errs.append(f"model.moe_router_topk={m.moe_router_topk} exceeds model.num_moe_experts="
                        f"{m.num_moe_experts}")
        if m.moe_ffn_hidden_size is None:
            errs.append("model.moe_ffn_hidden_size must be set when model.num_moe_experts is set")
        if m.moe_router_topk == 1 and m.moe_router_score_function == "softmax" and not m.moe_router_pre_softmax:
            errs.append("model.moe_router_topk=1 with the softmax router needs model.moe_router_pre_softmax=true "
                        "(renormalising a single probability would make every routing weight 1)")
    if isinstance(m.moe_layer_freq, list):
        if len(m.moe_layer_freq) != m.num_layers or set(m.moe_layer_freq) - {0, 1}:
            errs.append(f"model.moe_layer_freq as a list needs num_layers={m.num_layers} entries of 0/1, "
                        f"got {m.moe_layer_freq}")
    if not 0 < m.rotary_percent <= 1:
        errs.append(f"model.rotary_percent={m.rotary_percent} must be in (0, 1]")
    return errs


def check_parallel(m: ModelConfig, p: ParallelConfig, world_size: int | None) -> list[str]:
    errs = []
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    if min(tp, pp, ep, etp, p.context_parallel_size) < 1:
        errs.append("parallel sizes must all be >= 1")
        return errs
    if m.num_attention_heads % tp:
        errs.append(f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                    f"parallel.tensor_model_parallel_size={tp}: choose TP dividing the head count")
    if m.num_query_groups % tp:
        errs.append(f"model.num_query_groups={m.num_query_groups} is not divisible by "
                    f"parallel.tensor_model_parallel_size={tp}: choose TP <= and dividing the KV head count")
    if m.num_layers % pp:
        errs.append(f"model.num_layers={m.num_layers} is not divisible by "
                    f"parallel.pipeline_model_parallel_size={pp}")
    vpp = p.virtual_pipeline_model_parallel_size
    if vpp and m.num_layers % (pp * vpp):
        errs.append(f"model.num_layers={m.num_layers} is not divisible by PP*VPP={pp * vpp}")
    if m.num_moe_experts is None:
        if ep > 1:
            errs.append("parallel.expert_model_parallel_size > 1 needs an MoE model (model.num_moe_experts)")
    else:
        if m.num_moe_experts % ep:
            errs.append(f"model.num_moe_experts={m.num_moe_experts} is not divisible by "
                        f"parallel.expert_model_parallel_size={ep}: pick EP from "
                        f"{[d for d in range(1, m.num_moe_experts + 1) if m.num_moe_experts % d == 0]}")
        if tp > 1 and not p.sequence_parallel:
            errs.append("MoE with parallel.tensor_model_parallel_size > 1 requires "
                        "parallel.sequence_parallel=true (set --set parallel.sequence_parallel=true)")
    if p.context_parallel_size != 1:
        errs.append("parallel.context_parallel_size > 1 is not supported yet; set it to 1")
    if world_size is not None:
        model_size = tp * pp * p.context_parallel_size
        if world_size % model_size:
            errs.append(f"world size {world_size} is not divisible by TP*PP*CP={model_size}")
        elif m.num_moe_experts is not None and world_size % (etp * ep * pp):
            errs.append(f"world size {world_size} is not divisible by expert-TP*EP*PP={etp * ep * pp}")
    return errs


def resolved_mode(cfg: ExperimentConfig) -> str:
    """scheduler.mode with ``auto`` resolved from the algorithm (group algorithms need groups)."""
    if cfg.scheduler.mode != "auto":
        return cfg.scheduler.mode
    return "group" if objective(cfg.algorithm.name).grouped else "single"


def check_training(cfg: ExperimentConfig) -> list[str]:
    errs = []
    alg, sched, critic = cfg.algorithm, cfg.scheduler, cfg.critic
    if cfg.actor.ppo_epochs < 1 or cfg.actor.num_minibatches < 1:
        errs.append("actor.ppo_epochs and actor.num_minibatches must be >= 1 (1 and 1: one step per batch)")
    elif cfg.actor.num_minibatches > sched.batch_size:
        errs.append(f"actor.num_minibatches={cfg.actor.num_minibatches} exceeds scheduler.batch_size="
                    f"{sched.batch_size}: a mini-batch needs at least one sample")
    if critic.num_updates_per_step < 1:
        errs.append(f"critic.num_updates_per_step={critic.num_updates_per_step} must be >= 1 (paper: K=2)")
    if objective(alg.name).critic and not critic.enabled:
        errs.append(f"algorithm.name={alg.name} needs a value model: set critic.enabled=true")
    errs += check_algorithm(cfg)
    errs += check_routing_replay(cfg)
    errs += check_engine_recovery(cfg.rollout.engine_restart_budget, cfg.rollout.no_engine_timeout_s)
    if sched.max_staleness < 0:
        errs.append("scheduler.max_staleness must be >= 0 (0 = on-policy)")
    if sched.batch_size < 1 or sched.concurrency < 1:
        errs.append("scheduler.batch_size and scheduler.concurrency must be >= 1")
    if cfg.data.max_total_tokens > cfg.model.max_position_embeddings:
        errs.append(f"data.max_total_tokens={cfg.data.max_total_tokens} exceeds "
                    f"model.max_position_embeddings={cfg.model.max_position_embeddings}: lower the budget")
    if cfg.data.max_prompt_tokens >= cfg.data.max_total_tokens:
        errs.append(f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} leaves no room to generate "
                    f"within data.max_total_tokens={cfg.data.max_total_tokens}")
    if cfg.data.max_prompt_tokens >= cfg.model.max_position_embeddings:
        errs.append(f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} must be below "
                    f"model.max_position_embeddings={cfg.model.max_position_embeddings}")
    if cfg.data.task in _DATASET_TASKS and cfg.data.path is None:
        errs.append(f"data.task={cfg.data.task} needs data.path: a JSONL file, one object per line like "
                    f"{_DATASET_TASKS[cfg.data.task]} (examples/data/{cfg.data.task}_sample.jsonl shows the format)")
    if cfg.resources.offload_idle_optimizer and cfg.model.params_dtype == "fp32":
        errs.append("resources.offload_idle_optimizer needs model.params_dtype bf16 or fp16: with fp32 params the "
                    "optimizer's params are the model's own weights, which forward passes need on the device")
    return errs


def check_algorithm(cfg: ExperimentConfig) -> list[str]:
    """The algorithm section: groups where the objective needs them, each section's ranges, and no knob
    changed in a section the objective does not read (it would be accepted and do nothing)."""
    alg, obj, errs = cfg.algorithm, objective(cfg.algorithm.name), []
    grouped = resolved_mode(cfg) != "single"
    if obj.grouped and not grouped:
        errs.append(f"algorithm.name={alg.name} needs groups: set scheduler.mode=group (or sync)")
    if obj.grouped and alg.group_size < 2:
        errs.append(f"algorithm.group_size={alg.group_size} must be >= 2 for {alg.name}")
    if grouped and alg.group_size >= 1 and cfg.scheduler.batch_size % alg.group_size:
        errs.append(f"scheduler.batch_size={cfg.scheduler.batch_size} must be a multiple of "
                    f"algorithm.group_size={alg.group_size}")
    if not grouped and alg.group_size != _ALGORITHM_DEFAULTS.group_size:
        errs.append(f"algorithm.group_size={alg.group_size} is set, but samples come one per prompt "
                    f"(scheduler.mode resolves to single for algorithm.name={alg.name}): set it back to "
                    f"{_ALGORITHM_DEFAULTS.group_size} (or remove it), or set scheduler.mode=group")
    errs += _algorithm_ranges(alg)
    return errs + [e for section in _SECTIONS if section not in obj.sections for e in _unused_knobs(alg, section)]


def _algorithm_ranges(alg: AlgorithmConfig) -> list[str]:
    errs = []
    if not (0 <= alg.gae.gamma <= 1 and 0 <= alg.gae.lam <= 1):
        errs.append("algorithm.gae.gamma and algorithm.gae.lam must be in [0, 1]")
    if not 0 < alg.dis.eps_low <= 1:
        errs.append(f"algorithm.dis.eps_low={alg.dis.eps_low} must be in (0, 1]")
    if alg.dis.eps_high <= 0:
        errs.append(f"algorithm.dis.eps_high={alg.dis.eps_high} must be > 0")
    clip = alg.ppo_clip
    if not (0 <= clip.clip_low <= 1 and clip.clip_high >= 0):
        errs.append(f"algorithm.ppo_clip.clip_low={clip.clip_low} must be in [0, 1] and "
                    f"algorithm.ppo_clip.clip_high={clip.clip_high} >= 0")
    if clip.dual_clip is not None and clip.dual_clip <= 1:
        errs.append(f"algorithm.ppo_clip.dual_clip={clip.dual_clip} must be > 1 (or null)")
    momentum = alg.running_mean.momentum
    if momentum is not None and not 0 <= momentum < 1:
        errs.append(f"algorithm.running_mean.momentum={momentum} must be in [0, 1) (or null: the exact mean)")
    return errs


def _unused_knobs(alg: AlgorithmConfig, section: str) -> list[str]:
    """Each knob of ``algorithm.<section>`` changed from its default while the objective does not read it."""
    ours, default = getattr(alg, section), getattr(_ALGORITHM_DEFAULTS, section)
    return [f"algorithm.{section}.{f.name}={getattr(ours, f.name)!r} is set, but algorithm.name={alg.name} does "
            f"not read algorithm.{section} (read by {', '.join(users_of(section))}): set it back to "
            f"{getattr(default, f.name)!r} (or remove it), or choose one of those objectives"
            for f in dataclasses.fields(ours) if getattr(ours, f.name) != getattr(default, f.name)]


_ALGORITHM_DEFAULTS = AlgorithmConfig()
# The sections of the algorithm config, one per advantage estimator and policy loss of the objectives table.
_SECTIONS = tuple(sorted({s for o in OBJECTIVES.values() for s in o.sections}))


def check_routing_replay(cfg: ExperimentConfig) -> list[str]:
    """rollout.routing_replay needs routers to replay into and a token layout the replay can map."""
    if not cfg.rollout.routing_replay:
        return []
    errs = []
    if cfg.model.num_moe_experts is None:
        errs.append("rollout.routing_replay=true replays MoE routing, but model.num_moe_experts is unset (a dense "
                    "model has no router): set rollout.routing_replay=false")
    if cfg.parallel.context_parallel_size > 1:
        errs.append("rollout.routing_replay=true does not map routes onto context-parallel sequence shards: set "
                    "parallel.context_parallel_size=1 or rollout.routing_replay=false")
    r = cfg.rollout
    if r.router == "sglang_router" or r.router_url:
        # sglang-router 0.3.2 drops return_routed_experts from /generate (tests/sglang records it): every
        # episode would come back without routes and the replay would have nothing to replay.
        via = f"rollout.router_url={r.router_url}" if r.router_url else "rollout.router=sglang_router"
        errs.append(f"rollout.routing_replay=true cannot go through sglang-router ({via}): it drops "
                    "return_routed_experts from /generate requests. Set rollout.router=builtin, leave "
                    "rollout.router_url unset and list the SGLang servers in rollout.engine_urls instead (the "
                    "built-in router sends to them directly), or set rollout.routing_replay=false")
    return errs


def check_engine_recovery(restart_budget: int, no_engine_timeout_s: float) -> list[str]:
    errs = []
    if restart_budget < 0:
        errs.append(f"rollout.engine_restart_budget={restart_budget} must be >= 0 (restarts per engine; 0: never)")
    if not no_engine_timeout_s > 0:
        errs.append(f"rollout.no_engine_timeout_s={no_engine_timeout_s} must be > 0 (seconds without any healthy "
                    "engine before the run checkpoints and stops)")
    return errs


# Tasks without a built-in generator (sao_megatron.envs): their dataset line shape, for the error.
_DATASET_TASKS = {"math": '{"prompt": "...", "answer": "3/4"}', "code": '{"prompt": "...", "tests": "assert f(1) == 2"}'}


def check_resources(r: ResourcesConfig) -> list[str]:
    """Internal consistency of the cluster shape (the layout itself is checked by `sao-megatron plan`)."""
    errs = [f"resources.{name}={getattr(r, name)} must be >= 1"
            for name in ("nodes", "gpus_per_node", "rollout_tp_size", "rollout_ep_size") if getattr(r, name) < 1]
    if r.rollout_nodes < 0:
        errs.append(f"resources.rollout_nodes={r.rollout_nodes} must be >= 0")
    if r.gpu_mem_gb <= 0 or not 0 < r.rollout_mem_fraction <= 1:
        errs.append("resources.gpu_mem_gb must be > 0 and resources.rollout_mem_fraction in (0, 1]")
    if errs:
        return errs
    tp, gpn = r.rollout_tp_size, r.gpus_per_node
    if tp % r.rollout_ep_size:
        errs.append(f"resources.rollout_ep_size={r.rollout_ep_size} must divide resources.rollout_tp_size={tp}")
    if gpn % tp and tp % gpn:
        errs.append(f"resources.rollout_tp_size={tp} must divide gpus_per_node={gpn} or be a multiple of it")
    elif r.rollout_nodes and (r.rollout_nodes * gpn) % tp:
        errs.append(f"resources.rollout_nodes={r.rollout_nodes} x {gpn} GPUs do not split into servers of "
                    f"rollout_tp_size={tp} GPUs: use a multiple of {tp // gpn} rollout nodes")
    return errs
