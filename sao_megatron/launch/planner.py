"""Layout planner: exact parameter counts, topology checks and per-GPU memory before launch.

Pure arithmetic on the configs (no torch, no Megatron): ``sao-megatron plan`` runs in a
second on a login node. Parameter counts equal the numel of the Megatron ``GPTModel``
that ``models.builder`` builds (tested against the real model on CPU); memory is an
estimate with the assumptions stated next to each term (docs/scaling.md).

Memory model of one training GPU (actor or critic; mixed precision, Megatron DDP):
- weights in ``model.params_dtype`` (bf16: 2 bytes) for every local parameter;
- gradients in fp32 (4 bytes; Megatron accumulates bf16 grads in fp32) for trainable ones;
- Adam: fp32 main params (bf16 only) + two fp32 moments, sharded over the data-parallel
  group with the distributed optimizer (experts over the expert-data-parallel group);
  frozen parameters have neither gradients nor optimizer state;
- activations for one micro-batch of ``max_tokens_per_microbatch`` tokens per layer, times
  the micro-batches 1F1B keeps in flight on a stage (``pp - stage``), with flash attention,
  sequence parallelism and the chosen recompute; fp32 log-softmax buffers on the last stage;
- ``OVERHEAD_GIB`` for the CUDA context, NCCL and communication buffers, fragmentation;
  a layout fits when the total stays under ``USABLE_FRACTION`` of the GPU's memory.
Actor and critic are colocated: while one steps, the other's weights (and, unless
``resources.offload_idle_optimizer``, its grads and optimizer state) stay resident.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

from sao_megatron.config.schema import ExperimentConfig, ModelConfig, ParallelConfig, ResourcesConfig
from sao_megatron.config.validate import check_model, check_parallel
from sao_megatron.launch.dsa_fit import dsa_fit_errors
from sao_megatron.models import mla_sizes
from sao_megatron.models.arch import PARAM_GROUPS as GROUPS
from sao_megatron.models.arch import VOCAB_DIVISIBLE_BY, moe_layer_mask, padded_vocab_size
from sao_megatron.models.arch import head_dim as _head_dim

GIB = 2**30
OVERHEAD_GIB = 5.0
"""CUDA context + NCCL/all-to-all buffers + allocator fragmentation per training GPU."""
USABLE_FRACTION = 0.9
"""A layout fits when the estimate stays under this share of GPU memory: the margin covers transient
buffers the estimate leaves out (optimizer all-gather buckets, MoE permutation workspaces)."""
LOGITS_BYTES = 10
"""Per token and local vocab entry: bf16 logits + fp32 softmax and its gradient."""


def _norm_size(m: ModelConfig, dim: int) -> int:
    return 2 * dim if m.normalization == "LayerNorm" else dim


def layer_params(m: ModelConfig, moe: bool, *, tp: int = 1, ep: int = 1, etp: int = 1,
                 layer: int = 0) -> dict[str, int]:
    """Parameters of one transformer layer (global index ``layer``) held by one rank of a TP x EP x expert-TP layout.

    Matrices are split exactly (validated divisibility); norms and the router are replicated.
    """
    h, d = m.hidden_size, _head_dim(m)
    q, kv = m.num_attention_heads * d, m.num_query_groups * d
    qkv_rows = (q + 2 * kv) // tp
    attention = qkv_rows * h + (qkv_rows if m.add_qkv_bias else 0) + (q // tp) * h
    if m.qk_layernorm:
        attention += 2 * _norm_size(m, d)
    if m.multi_latent_attention:
        attention = mla_sizes.attention_params(m, layer, tp)
    out = dict.fromkeys(GROUPS, 0)
    out["attention"] = attention
    out["norms"] = 2 * _norm_size(m, m.hidden_size)
    if not moe:
        out["dense_mlp"] = 3 * h * m.ffn_hidden_size // tp
        return out
    experts, f = m.num_moe_experts, m.moe_ffn_hidden_size
    out["router"] = experts * h
    out["routed_experts"] = (experts // ep) * 3 * h * f // etp
    if m.moe_shared_expert_intermediate_size:
        out["shared_experts"] = 3 * h * m.moe_shared_expert_intermediate_size // tp
    return out


@dataclasses.dataclass(frozen=True)
class ParamCount:
    """Whole-model parameter counts (the numel of the Megatron model at TP=1)."""

    total: int
    """All parameters."""
    active: int
    """Parameters one token uses: total minus the routed experts it is not sent to."""
    groups: dict[str, int]
    """Per parameter group (see models.arch.PARAM_GROUPS)."""


def count_params(m: ModelConfig, *, critic: bool = False, divisible_by: int = VOCAB_DIVISIBLE_BY) -> ParamCount:
    """Exact parameter count of the model built on one GPU (vocab padded to ``divisible_by``;
    1 gives the unpadded count of the HF checkpoint)."""
    groups = stage_params(m, SINGLE_GPU, 0, critic=critic, divisible_by=divisible_by)
    total = sum(groups.values())
    inactive = 0
    if m.num_moe_experts:
        per_expert = 3 * m.hidden_size * m.moe_ffn_hidden_size
        inactive = sum(moe_layer_mask(m)) * (m.num_moe_experts - m.moe_router_topk) * per_expert
    return ParamCount(total=total, active=total - inactive, groups=groups)


def value_head_params(m: ModelConfig) -> int:
    """Scalar value head: Linear(hidden, 1) with bias (models.critic)."""
    return m.hidden_size + 1


@dataclasses.dataclass(frozen=True)
class Layout:
    """One trainer layout on a cluster."""

    nodes: int
    gpus_per_node: int
    tp: int
    pp: int
    ep: int
    etp: int
    vpp: int | None = None
    sequence_parallel: bool = True
    distributed_optimizer: bool = True

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def expert_dp(self) -> int:
        return self.world // (self.etp * self.ep * self.pp)

    def describe(self) -> str:
        vpp = f" VPP{self.vpp}" if self.vpp else ""
        return (f"{self.nodes}x{self.gpus_per_node} GPUs: TP{self.tp} PP{self.pp}{vpp} EP{self.ep} "
                f"ETP{self.etp} DP{self.dp} (expert-DP {self.expert_dp})")


SINGLE_GPU = Layout(nodes=1, gpus_per_node=1, tp=1, pp=1, ep=1, etp=1)


def layout_from_config(p: ParallelConfig, r: ResourcesConfig) -> Layout:
    return Layout(nodes=r.nodes, gpus_per_node=r.gpus_per_node, tp=p.tensor_model_parallel_size,
                  pp=p.pipeline_model_parallel_size, ep=p.expert_model_parallel_size,
                  etp=p.expert_tensor_parallel_size or p.tensor_model_parallel_size,
                  vpp=p.virtual_pipeline_model_parallel_size, sequence_parallel=p.sequence_parallel,
                  distributed_optimizer=p.use_distributed_optimizer)


def stage_layers(m: ModelConfig, lay: Layout, stage: int) -> list[int]:
    """Layer indices on pipeline stage ``stage``: contiguous blocks, or every pp-th chunk with VPP."""
    chunks = lay.vpp if lay.vpp and lay.pp > 1 else 1
    per_chunk = m.num_layers // (lay.pp * chunks)
    return [(v * lay.pp + stage) * per_chunk + i for v in range(chunks) for i in range(per_chunk)]


def stage_params(m: ModelConfig, lay: Layout, stage: int, *, critic: bool,
                 divisible_by: int = VOCAB_DIVISIBLE_BY) -> dict[str, int]:
    """Parameters per group held by one rank of pipeline stage ``stage`` (PP splits layers evenly)."""
    moe_mask = moe_layer_mask(m)
    out = dict.fromkeys(GROUPS, 0)
    for layer in stage_layers(m, lay, stage):
        for k, v in layer_params(m, moe_mask[layer], tp=lay.tp, ep=lay.ep, etp=lay.etp, layer=layer).items():
            out[k] += v
    vocab_rows = padded_vocab_size(m.vocab_size, lay.tp, divisible_by) // lay.tp
    if stage == 0:
        out["embedding"] = vocab_rows * m.hidden_size
    if stage == lay.pp - 1:
        out["norms"] += _norm_size(m, m.hidden_size)
        if critic:
            out["value_head"] = value_head_params(m)
        elif m.untie_embeddings_and_output_weights or lay.pp > 1:  # tied: a copy on the last stage
            out["lm_head"] = vocab_rows * m.hidden_size
    return out


def activation_bytes_per_token(m: ModelConfig, moe: bool, lay: Layout, recompute: str) -> float:
    """Bytes one token leaves saved for backward in one layer on one rank (bf16, flash attention).

    Sequence parallelism splits the hidden-sized tensors over TP like the head-sized ones;
    routed experts see ``topk`` copies of a token, gathered over expert-TP.
    ``selective`` drops what Megatron's recompute_modules [core_attn, moe_act, layernorm] recompute.
    """
    h, d = m.hidden_size, _head_dim(m)
    q, kv = m.num_attention_heads * d, m.num_query_groups * d
    qk_norm_inputs = 2 * (q + kv) if m.qk_layernorm else 0
    norm_outputs = 2 * 2 * h
    attn = 2 * h + qk_norm_inputs + 2 * (q + 2 * kv) + 2 * q + 4 * m.num_attention_heads
    if m.multi_latent_attention:
        attn = mla_sizes.attention_activation_bytes(m, lay.tp)
    if moe:
        f, k, s = m.moe_ffn_hidden_size, m.moe_router_topk, m.moe_shared_expert_intermediate_size or 0
        mlp = 2 * h + 8 * m.num_moe_experts + k * (4 * h * lay.etp + 6 * f) + 6 * s
        act_outputs = 2 * (k * f + s)
    else:
        mlp = 2 * h + 6 * m.ffn_hidden_size
        act_outputs = 2 * m.ffn_hidden_size
    total = attn + mlp + norm_outputs
    if recompute == "selective":
        total -= norm_outputs + act_outputs
    split = lay.tp if lay.sequence_parallel or lay.tp == 1 else 1
    return total / split


@dataclasses.dataclass(frozen=True)
class RoleMemory:
    """Per-GPU memory of one training role on its most loaded pipeline stage (GiB)."""

    role: str
    stage: int
    params: int
    trainable: int
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float

    @property
    def static_gib(self) -> float:
        return self.weights_gib + self.grads_gib + self.optimizer_gib

    @property
    def total_gib(self) -> float:
        return self.static_gib + self.activations_gib


def _stage_memory(m: ModelConfig, lay: Layout, stage: int, *, role: str, trainable: set[str], tokens: int,
                  recompute: str, seq: int | None = None) -> RoleMemory:
    params = stage_params(m, lay, stage, critic=role == "critic")
    train = {g: n for g, n in params.items() if "all" in trainable or g in trainable}
    dense_train = sum(n for g, n in train.items() if g != "routed_experts")
    expert_train = train.get("routed_experts", 0)
    wbytes = 4 if m.params_dtype == "fp32" else 2
    opt_bytes = 8 + (4 if wbytes == 2 else 0)
    dp, edp = (lay.dp, lay.expert_dp) if lay.distributed_optimizer else (1, 1)
    optimizer = opt_bytes * (dense_train / dp + expert_train / edp)
    acts = _stage_activations(m, lay, stage, tokens, recompute) + _stage_dsa_bytes(m, lay, stage, tokens, recompute,
                                                                                   seq or tokens)
    if role == "actor" and stage == lay.pp - 1:
        acts += tokens * padded_vocab_size(m.vocab_size, lay.tp) / lay.tp * LOGITS_BYTES
    total, ntrain = sum(params.values()), sum(train.values())
    return RoleMemory(role=role, stage=stage, params=total, trainable=ntrain, weights_gib=wbytes * total / GIB,
                      grads_gib=4 * ntrain / GIB, optimizer_gib=optimizer / GIB, activations_gib=acts / GIB)


def _stage_activations(m: ModelConfig, lay: Layout, stage: int, tokens: int, recompute: str) -> float:
    moe_mask = moe_layer_mask(m)
    mask = [moe_mask[i] for i in stage_layers(m, lay, stage)]
    per_layer = [activation_bytes_per_token(m, moe, lay, recompute) * tokens for moe in mask]
    in_flight = lay.pp - stage
    if lay.vpp and lay.pp > 1:  # interleaving keeps extra warm-up micro-batches (Narayanan et al. 2021)
        in_flight *= 1 + (lay.pp - 1) / (lay.pp * lay.vpp)
    if recompute == "full":  # keep each layer's input; recompute one layer at a time in backward
        split = lay.tp if lay.sequence_parallel or lay.tp == 1 else 1
        return in_flight * len(mask) * 2 * m.hidden_size * tokens / split + max(per_layer, default=0)
    return in_flight * sum(per_layer)


def _stage_dsa_bytes(m: ModelConfig, lay: Layout, stage: int, tokens: int, recompute: str, seq: int) -> float:
    """DSA attention memory that is not linear in tokens (``mla_sizes.dsa_attention_bytes``): the
    micro-batch as sequences of the longest length, saved tensors per layer and micro-batch in
    flight (none with recompute: core attention is recomputed), plus one layer's transient peak."""
    layers = mla_sizes.dsa_layers(m, stage_layers(m, lay, stage))
    if not layers:
        return 0.0
    seq = min(seq, tokens)
    saved, transient = mla_sizes.dsa_attention_bytes(m, tp=lay.tp, seq=seq, batch=max(tokens // seq, 1))
    kept = 0.0 if recompute in ("full", "selective") else saved * layers * (lay.pp - stage)
    return kept + transient


def iter_layouts(m: ModelConfig, nodes: int, gpus_per_node: int, *, max_pp: int = 16) -> Iterator[Layout]:
    """Candidate layouts on ``nodes`` nodes, in order of preference: fewer PP, smaller TP, ETP, EP."""
    world = nodes * gpus_per_node
    experts = m.num_moe_experts or 1
    tps = [t for t in _divisors(gpus_per_node) if m.num_query_groups % t == 0 and m.num_attention_heads % t == 0]
    for pp in [p for p in _divisors(m.num_layers) if p <= max_pp and world % p == 0]:
        for tp in tps:
            if world % (tp * pp):
                continue
            for etp in sorted({1, tp}):  # fine-grained experts: EP before expert-TP
                for ep in _divisors(experts):
                    if world % (etp * ep * pp) == 0:
                        yield Layout(nodes=nodes, gpus_per_node=gpus_per_node, tp=tp, pp=pp, ep=ep, etp=etp)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_layout(cfg: ExperimentConfig, lay: Layout) -> list[str]:
    """Topology and divisibility errors of the trainer layout, each with its fix."""
    m, p = cfg.model, dataclasses.replace(
        cfg.parallel, tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
        expert_model_parallel_size=lay.ep, expert_tensor_parallel_size=lay.etp,
        virtual_pipeline_model_parallel_size=lay.vpp, sequence_parallel=lay.sequence_parallel)
    errs = check_model(m) + check_parallel(m, p, lay.world)
    gpn = lay.gpus_per_node
    for name, size in (("tensor_model_parallel_size", lay.tp), ("expert_tensor_parallel_size", lay.etp)):
        if size > gpn or gpn % size:
            errs.append(f"parallel.{name}={size} does not fit in one node of {gpn} GPUs: TP collectives run "
                        f"every layer and need NVLink; use a divisor of {gpn} and add PP/EP instead")
    if errs:
        return errs
    for role, tokens in (("actor", cfg.actor.max_tokens_per_microbatch),
                         ("critic", cfg.critic.max_tokens_per_microbatch)):
        if role == "critic" and not cfg.critic.enabled:
            continue
        if tokens < cfg.data.max_total_tokens:
            errs.append(f"{role}.max_tokens_per_microbatch={tokens} < data.max_total_tokens="
                        f"{cfg.data.max_total_tokens}: a whole sample must fit one micro-batch; raise it")
    if cfg.scheduler.batch_size < lay.dp:
        errs.append(f"scheduler.batch_size={cfg.scheduler.batch_size} < data-parallel size {lay.dp}: some DP "
                    f"ranks would get no sample; use fewer nodes or more TP/PP")
    return errs


# ---------------------------------------------------------------- rollout servers


def rollout_params_per_gpu(m: ModelConfig, tp: int) -> int:
    """Parameters on one GPU of an SGLang server with --tp-size ``tp`` (EP inside TP: experts / tp).

    KV heads are replicated when tp exceeds their number (each GPU keeps at least one).
    """
    h, d = m.hidden_size, _head_dim(m)
    q = m.num_attention_heads * d // tp
    kv = max(1, m.num_query_groups // tp) * d
    attn = (q + 2 * kv) * h + (q + 2 * kv if m.add_qkv_bias else 0) + q * h
    attn += 2 * _norm_size(m, d) if m.qk_layernorm else 0
    total = 0
    for layer, moe in enumerate(moe_layer_mask(m)):
        total += attn + 2 * _norm_size(m, h)
        if m.multi_latent_attention:
            total += mla_sizes.attention_params(m, layer, tp) - attn
        if moe:
            total += m.num_moe_experts * h + m.num_moe_experts * 3 * h * m.moe_ffn_hidden_size // tp
            total += 3 * h * (m.moe_shared_expert_intermediate_size or 0) // tp
        else:
            total += 3 * h * m.ffn_hidden_size // tp
    heads = 2 if m.untie_embeddings_and_output_weights else 1
    return total + heads * math.ceil(m.vocab_size / tp) * h + _norm_size(m, h)


def kv_bytes_per_token(m: ModelConfig, tp: int) -> int:
    """bf16 K and V of one token, all layers, on one GPU of a --tp-size ``tp`` server."""
    if m.multi_latent_attention:
        return mla_sizes.kv_bytes_per_token(m)
    return 2 * m.num_layers * max(1, m.num_query_groups // tp) * _head_dim(m) * 2


@dataclasses.dataclass(frozen=True)
class RolloutMemory:
    """Per-GPU memory of one SGLang server planned for its share of the scheduler's concurrency."""

    servers: int
    gpus_per_server: int
    sequences_per_server: int
    weights_gib: float
    kv_cache_gib: float
    budget_gib: float
    kv_capacity_tokens: int

    @property
    def total_gib(self) -> float:
        return self.weights_gib + self.kv_cache_gib

    @property
    def fits(self) -> bool:
        return self.total_gib <= self.budget_gib


def rollout_memory(cfg: ExperimentConfig, r: ResourcesConfig) -> RolloutMemory | None:
    """Weights + KV cache for ``concurrency / servers`` sequences of ``data.max_total_tokens`` (worst case)."""
    tp = r.rollout_tp_size
    servers = r.rollout_nodes * r.gpus_per_node // tp
    if servers < 1:
        return None
    seqs = math.ceil(cfg.scheduler.concurrency / servers)
    kv_tok = kv_bytes_per_token(cfg.model, tp)
    budget = r.rollout_mem_fraction * r.gpu_mem_gb
    weights = 2 * rollout_params_per_gpu(cfg.model, tp) / GIB
    capacity = int(max(0.0, budget - weights) * GIB / kv_tok)
    return RolloutMemory(servers=servers, gpus_per_server=tp, sequences_per_server=seqs, weights_gib=weights,
                         kv_cache_gib=seqs * cfg.data.max_total_tokens * kv_tok / GIB, budget_gib=budget,
                         kv_capacity_tokens=capacity)


def check_rollout(cfg: ExperimentConfig, r: ResourcesConfig) -> list[str]:
    m, tp = cfg.model, r.rollout_tp_size
    if cfg.rollout.engine != "sglang":
        return []
    errs = []
    if r.rollout_nodes < 1:
        errs.append("rollout.engine=sglang needs GPU servers: set resources.rollout_nodes >= 1")
    elif r.rollout_nodes * r.gpus_per_node < tp:
        errs.append(f"resources.rollout_tp_size={tp} needs {tp} GPUs but rollout_nodes x gpus_per_node = "
                    f"{r.rollout_nodes * r.gpus_per_node}: add rollout nodes or lower rollout_tp_size")
    if m.num_attention_heads % tp:
        errs.append(f"resources.rollout_tp_size={tp} does not divide model.num_attention_heads="
                    f"{m.num_attention_heads} (SGLang shards heads over TP): pick a divisor")
    if m.num_moe_experts and m.num_moe_experts % r.rollout_ep_size:
        errs.append(f"resources.rollout_ep_size={r.rollout_ep_size} does not divide model.num_moe_experts="
                    f"{m.num_moe_experts}")
    return errs


def suggest_rollout_tp(cfg: ExperimentConfig, r: ResourcesConfig) -> int | None:
    """Smallest server size (GPUs) whose weights + KV cache fit on the configured rollout nodes."""
    for tp in [2**i for i in range(12)]:
        if tp > max(r.rollout_nodes, 1) * r.gpus_per_node:
            return None
        if (r.gpus_per_node % tp and tp % r.gpus_per_node) or cfg.model.num_attention_heads % tp:
            continue
        mem = rollout_memory(cfg, dataclasses.replace(r, rollout_tp_size=tp, rollout_ep_size=1))
        if mem is not None and mem.fits:
            return tp
    return None


# ---------------------------------------------------------------- the plan


def weight_sync_seconds(num_bytes: float, *, nccl_gbps: float = 40.0, disk_gbps: float = 5.0) -> dict[str, float]:
    """Time to push the actor's bf16 weights to the engines once (per actor step).

    NCCL: one pipelined broadcast at ``nccl_gbps`` GB/s (one 400 Gb/s NIC at ~80%): every engine GPU
    receives all bytes, so the time does not grow with the number of engines. Disk: the trainer writes
    safetensors at ``disk_gbps`` GB/s, every rollout node then reads them at the same rate in parallel.
    """
    return {"bytes": float(num_bytes), "nccl_s": num_bytes / (nccl_gbps * 1e9),
            "disk_s": 2 * num_bytes / (disk_gbps * 1e9)}


@dataclasses.dataclass
class Plan:
    """What `sao-megatron plan` reports for one config on one cluster shape."""

    layout: Layout
    params: ParamCount
    critic_params: ParamCount | None
    errors: list[str]
    actor: RoleMemory | None = None
    critic: RoleMemory | None = None
    trainer_peak_gib: float = 0.0
    budget_gib: float = 0.0
    rollout: RolloutMemory | None = None
    suggestion: Layout | None = None
    suggested_rollout_tp: int | None = None
    weight_sync: dict[str, float] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def fits(self) -> bool:
        return (not self.errors and self.trainer_peak_gib <= self.budget_gib
                and (self.rollout is None or self.rollout.fits))


def trainer_peak_gib(cfg: ExperimentConfig, lay: Layout) -> tuple[float, RoleMemory, RoleMemory | None]:
    """Peak per-GPU memory of the colocated actor + critic (max over stages and phases), with overhead."""
    actor_trainable = {"all"}
    critic_trainable = set(cfg.critic.trainable)
    best, peak_actor, peak_critic = -1.0, None, None
    for s in range(lay.pp):
        a = _stage_memory(cfg.model, lay, s, role="actor", trainable=actor_trainable,
                          tokens=cfg.actor.max_tokens_per_microbatch, recompute=cfg.actor.recompute_granularity,
                          seq=cfg.data.max_total_tokens)
        c = None
        peak = a.total_gib
        if cfg.critic.enabled:
            c = _stage_memory(cfg.model, lay, s, role="critic", trainable=critic_trainable,
                              tokens=cfg.critic.max_tokens_per_microbatch,
                              recompute=cfg.critic.recompute_granularity, seq=cfg.data.max_total_tokens)
            peak = max(a.total_gib + _resident(c, cfg), c.total_gib + _resident(a, cfg))
        if peak > best:
            best, peak_actor, peak_critic = peak, a, c
    return best + OVERHEAD_GIB, peak_actor, peak_critic


def _resident(mem: RoleMemory, cfg: ExperimentConfig) -> float:
    """What the idle model keeps on the GPU while the other one steps."""
    return mem.weights_gib if cfg.resources.offload_idle_optimizer else mem.static_gib


def make_plan(cfg: ExperimentConfig, *, suggest: bool = True, max_nodes: int = 64,
              nccl_gbps: float = 40.0, disk_gbps: float = 5.0) -> Plan:
    """Check and size ``cfg`` on ``cfg.resources``; optionally search the smallest layout that fits."""
    r = cfg.resources
    lay = layout_from_config(cfg.parallel, r)
    hf_params = count_params(cfg.model, divisible_by=1)  # unpadded vocab: what the engines load
    rollout_errors = check_rollout(cfg, r)
    plan = Plan(layout=lay, params=count_params(cfg.model),
                critic_params=count_params(cfg.model, critic=True) if cfg.critic.enabled else None,
                errors=check_layout(cfg, lay) + rollout_errors, notes=plan_notes(cfg, lay),
                budget_gib=USABLE_FRACTION * r.gpu_mem_gb,
                weight_sync=weight_sync_seconds(2 * hf_params.total, nccl_gbps=nccl_gbps, disk_gbps=disk_gbps))
    if lay.dp >= 1 and lay.expert_dp >= 1:
        plan.trainer_peak_gib, plan.actor, plan.critic = trainer_peak_gib(cfg, lay)
        plan.errors += dsa_fit_errors(cfg, lay, plan.trainer_peak_gib, plan.budget_gib, peak=trainer_peak_gib)
    if not rollout_errors:
        plan.rollout = rollout_memory(cfg, r)
    if suggest:
        plan.suggestion = smallest_fitting_layout(cfg, max_nodes=max_nodes)
        if cfg.rollout.engine == "sglang" and r.rollout_nodes:
            plan.suggested_rollout_tp = suggest_rollout_tp(cfg, r)
    return plan


def plan_notes(cfg: ExperimentConfig, lay: Layout) -> list[str]:
    """Facts worth knowing that are not errors: vocab padding, replicated KV heads, host memory for offload."""
    m, r, notes = cfg.model, cfg.resources, []
    padded = padded_vocab_size(m.vocab_size, lay.tp)
    if padded != m.vocab_size:
        notes.append(f"vocab {m.vocab_size} is padded to {padded} rows at TP{lay.tp} (multiple of "
                     f"{VOCAB_DIVISIBLE_BY} x TP); log-probs mask the padding and the HF export drops it")
    if r.rollout_tp_size > m.num_query_groups and cfg.rollout.engine == "sglang":
        notes.append(f"rollout_tp_size={r.rollout_tp_size} > {m.num_query_groups} KV heads: SGLang replicates "
                     f"KV heads, so each GPU caches one head per layer")
    if r.offload_idle_optimizer and cfg.critic.enabled:
        idle = [count_params(m).total, count_params(m, critic=True).total]
        host = max(idle) * 16 / (GIB * r.nodes)  # fp32 grads + main params + two Adam moments
        notes.append(f"offload_idle_optimizer keeps up to ~{host:.0f} GiB of optimizer state and grads per node "
                     f"in host memory")
    return notes


def smallest_fitting_layout(cfg: ExperimentConfig, *, max_nodes: int = 64) -> Layout | None:
    """Fewest nodes first, then the preference order of ``iter_layouts``; keeps recompute/offload choices."""
    r = cfg.resources
    budget = USABLE_FRACTION * r.gpu_mem_gb
    floor = _static_bytes_floor(cfg)
    for nodes in range(1, max_nodes + 1):
        if floor / (nodes * r.gpus_per_node) / GIB + OVERHEAD_GIB > budget:
            continue  # even perfectly sharded static memory would not fit
        for lay in iter_layouts(cfg.model, nodes, r.gpus_per_node):
            lay = dataclasses.replace(lay, distributed_optimizer=cfg.parallel.use_distributed_optimizer)
            if not check_layout(cfg, lay) and trainer_peak_gib(cfg, lay)[0] <= budget:
                return lay
    return None


def _static_bytes_floor(cfg: ExperimentConfig) -> float:
    """Cluster-wide bytes that stay resident whatever the layout: each parameter once, fully sharded."""
    actor = count_params(cfg.model).total * 18  # bf16 weight + fp32 grad + fp32 main param + 2 moments
    if not cfg.critic.enabled:
        return actor
    critic = count_params(cfg.model, critic=True)
    frozen = sum(n for g, n in critic.groups.items() if g not in cfg.critic.trainable and "all" not in
                 cfg.critic.trainable)
    critic_bytes = 2 * critic.total + 16 * (critic.total - frozen)
    if cfg.resources.offload_idle_optimizer:
        return max(actor + 2 * critic.total, critic_bytes + 2 * count_params(cfg.model).total)
    return actor + critic_bytes


def apply_layout(cfg: ExperimentConfig, lay: Layout) -> ExperimentConfig:
    """``cfg`` with ``lay``'s trainer layout (for `plan --apply`-style reuse and tests)."""
    p = dataclasses.replace(cfg.parallel, tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
                            expert_model_parallel_size=lay.ep, expert_tensor_parallel_size=lay.etp,
                            virtual_pipeline_model_parallel_size=lay.vpp, sequence_parallel=lay.tp > 1)
    r = dataclasses.replace(cfg.resources, nodes=lay.nodes, gpus_per_node=lay.gpus_per_node)
    return dataclasses.replace(cfg, parallel=p, resources=r)
