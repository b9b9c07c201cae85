"""Typed configuration of every component.

Each component owns one dataclass; the root ``ExperimentConfig`` only nests
them and is never passed below the entry points. Model and parallel fields use
Megatron-core's own names (``TransformerConfig`` / ``ModelParallelConfig`` /
``OptimizerConfig``) so no rename tables are needed (``models/`` builds the
``TransformerConfig`` in exactly one place).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

cfg = dataclass(kw_only=True, slots=True)


@cfg
class ModelConfig:
    """Architecture of the actor (and the critic trunk); Megatron field names."""

    family: Literal["qwen3_moe", "glm4_moe", "deepseek_v3", "glm_moe_dsa", "deepseek_v32"] = "qwen3_moe"
    """Model family: selects the HF<->Megatron mapping and family defaults."""
    num_layers: int = 2
    """Number of transformer layers."""
    hidden_size: int = 64
    """Hidden (model) dimension."""
    ffn_hidden_size: int = 128
    """FFN size of dense (non-MoE) layers."""
    num_attention_heads: int = 4
    """Number of query heads."""
    num_query_groups: int = 2
    """Number of KV heads (GQA groups)."""
    kv_channels: int | None = None
    """Head dimension; None means hidden_size // num_attention_heads."""
    num_moe_experts: int | None = 4
    """Routed experts per MoE layer; None builds a dense model."""
    moe_ffn_hidden_size: int | None = 64
    """FFN size of each routed expert."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_shared_expert_intermediate_size: int | None = None
    """Total FFN size of the shared expert(s); None means no shared expert."""
    moe_layer_freq: int | list[int] = 1
    """1 = every layer MoE; a list of 0/1 per layer marks dense (0) and MoE (1) layers."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router scoring (Qwen3: softmax; GLM-4.5: sigmoid)."""
    moe_router_pre_softmax: bool = False
    """Softmax before top-k (True = no renormalisation of the top-k probabilities)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free expert bias in the router (GLM-4.5 e_score_correction_bias)."""
    moe_router_topk_scaling_factor: float | None = None
    """Scale applied to routing weights (GLM routed_scaling_factor)."""
    moe_router_dtype: Literal["fp32", "fp64"] | None = "fp32"
    """Router computation dtype."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing auxiliary loss coefficient (0 in RL fine-tuning)."""
    moe_token_dispatcher_type: Literal["allgather", "alltoall"] = "alltoall"
    """Token dispatcher (flex/DeepEP needs GPUs)."""
    qk_layernorm: bool = True
    """RMSNorm on queries and keys per head (Qwen3)."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection (GLM-4.5)."""
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    """Norm type."""
    layernorm_epsilon: float = 1e-6
    """Norm epsilon (HF rms_norm_eps)."""
    rotary_base: int = 10000
    """RoPE base (HF rope_theta)."""
    rotary_percent: float = 1.0
    """Fraction of the head dim that is rotated (HF partial_rotary_factor)."""
    vocab_size: int = 128
    """Vocabulary size (the tokenizer's); padded for TP in models/."""
    max_position_embeddings: int = 512
    """Longest sequence (prompt + trajectory) the model is run on."""
    untie_embeddings_and_output_weights: bool = True
    """Separate LM head (Qwen3-MoE: True)."""
    init_method_std: float = 0.02
    """Init std for randomly initialised models."""
    params_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Parameter/compute dtype (bf16 on GPU, fp32 on CPU)."""
    hf_dir: str | None = None
    """Optional HF checkpoint directory the run starts from (converted at start)."""
    # Multi-head latent attention (DeepSeek-V3, GLM-5): Megatron's MLATransformerConfig fields.
    multi_latent_attention: bool = False
    """MLA: LoRA-compressed q and kv (DeepSeek-V3, GLM-5); the GQA fields above are then unused."""
    q_lora_rank: int | None = None
    """MLA query compression rank (HF q_lora_rank); None projects queries directly."""
    kv_lora_rank: int = 512
    """MLA key/value compression rank (HF kv_lora_rank)."""
    qk_head_dim: int = 128
    """MLA per-head q/k dimension without rope (HF qk_nope_head_dim)."""
    qk_pos_emb_head_dim: int = 64
    """MLA per-head rotary q/k dimension (HF qk_rope_head_dim)."""
    v_head_dim: int = 128
    """MLA per-head value dimension (HF v_head_dim)."""
    rope_type: Literal["rope", "yarn"] = "rope"
    """MLA rotary embedding: plain rope or YaRN (HF rope_scaling type yarn)."""
    rotary_scaling_factor: float = 1.0
    """YaRN scaling factor (HF rope_scaling.factor)."""
    original_max_position_embeddings: int = 4096
    """YaRN original context length (HF rope_scaling.original_max_position_embeddings)."""
    beta_fast: float = 32.0
    """YaRN beta_fast."""
    beta_slow: float = 1.0
    """YaRN beta_slow."""
    mscale: float = 1.0
    """YaRN mscale."""
    mscale_all_dim: float = 0.0
    """YaRN mscale_all_dim (also scales the attention softmax)."""
    moe_router_num_groups: int | None = None
    """Group-limited routing: expert groups (DeepSeek-V3 n_group); None = no grouping."""
    moe_router_group_topk: int | None = None
    """Group-limited routing: groups each token may use (DeepSeek-V3 topk_group)."""
    experimental_attention_variant: Literal["dsa"] | None = None
    """"dsa": DeepSeek sparse attention on top of MLA (GLM-5, DeepSeek-V3.2)."""
    dsa_indexer_n_heads: int | None = None
    """DSA indexer heads (HF index_n_heads)."""
    dsa_indexer_head_dim: int | None = None
    """DSA indexer head dimension (HF index_head_dim)."""
    dsa_indexer_topk: int | None = None
    """Keys each query attends to under DSA (HF index_topk)."""
    dsa_indexer_topk_freq: int = 1
    """Every n-th layer runs its indexer, the others reuse its top-k (GLM-5 indexer_types)."""
    dsa_indexer_skip_topk_offset: int = 0
    """Layers before the shared-top-k schedule starts (GLM-5 indexer_types)."""
    dsa_indexer_rope_interleaved: bool = False
    """Indexer RoPE on interleaved pairs (GLM-5: true; DeepSeek-V3.2: false)."""
    dsa_indexer_rotate_activation: bool = True
    """Hadamard rotation of indexer q and k (leaves their dot products unchanged)."""
    dsa_indexer_k_norm_epsilon: float | None = None
    """Epsilon of the indexer's key LayerNorm (HF: 1e-6); None = layernorm_epsilon."""
    dsa_kernel_backend: Literal["none", "tilelang", "cudnn"] = "none"
    """megatron's DSA kernels: none = unfused PyTorch, fp32 [s, b, heads, s] scores (CPU, short sequences);
    tilelang = fused indexer + sparse MLA (CUDA + tilelang; GLM-5 full length); cudnn (+ flash_mla)."""
    dsa_indexer_loss_coeff: float = 0.0
    """Indexer KL loss against the main attention (DeepSeek-V3.2, sparse); 0 = off and the indexer frozen."""
    mtp_num_layers: int | None = None
    """Multi-token-prediction layers in the HF checkpoint (kept aside, frozen: not in the Megatron model)."""


@cfg
class ParallelConfig:
    """Parallel layout shared by actor and critic (Megatron names)."""

    tensor_model_parallel_size: int = 1
    """TP degree (within a node)."""
    pipeline_model_parallel_size: int = 1
    """PP degree."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Interleaved PP chunks per stage (None = non-interleaved)."""
    expert_model_parallel_size: int = 1
    """EP degree."""
    expert_tensor_parallel_size: int | None = None
    """TP degree inside experts (None = same as TP)."""
    context_parallel_size: int = 1
    """CP degree (1 only for now)."""
    sequence_parallel: bool = False
    """Sequence parallelism (required with MoE and TP > 1)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer state over DP (Megatron distributed optimizer)."""
    distributed_timeout_minutes: int = 30
    """Collective timeout; a hang fails with a diagnostic after this long."""


@cfg
class OptimizerConfig:
    """Adam + LR schedule for one model (Megatron OptimizerConfig names)."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of the decay."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """LR decay after warm-up."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""


@cfg
class ActorConfig:
    """Policy training."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Actor optimizer."""
    max_tokens_per_microbatch: int = 4096
    """Token budget per micro-batch (dynamic micro-batching / packing)."""
    recompute_granularity: Literal["none", "selective", "full"] = "none"
    """Activation recomputation."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    ppo_epochs: int = 1
    """Passes over each batch (PPO-style). With >1 a clip against the old policy (grpo) bites; SAO's default is
    one step per batch. The policy version advances once per batch, the LR schedule once per optimizer step."""
    num_minibatches: int = 1
    """Optimizer steps per pass: the batch is split into this many mini-batches (each normalised by its own
    global token count)."""
    load: str | None = None
    """Megatron checkpoint to initialise the actor from (None: model.hf_dir or random)."""
    reset_optimizer_before_rl: bool = False
    """Start RL with a fresh Adam state (moments and step counts zero) after the supervised warm-up
    (run.sft_steps), whose Adam statistics otherwise carry into RL. actor.load restores weights only, so RL
    after a loaded warm-up starts fresh either way; this states it."""
    log_update_norm: bool = False
    """Log actor/update_norm, the norm of this rank's actor parameter change over a batch's optimizer steps
    (the whole actor in a single-process run); costs a copy of the trainable parameters per step."""


@cfg
class CriticConfig:
    """Value model: actor trunk + scalar head, frozen attention, K updates per actor step."""

    enabled: bool = True
    """False for critic-free algorithms (grpo, sao_running_mean)."""
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    """Critic optimizer."""
    num_updates_per_step: int = 2
    """K: critic optimizer steps per actor step (paper: 2)."""
    trainable: list[str] = field(default_factory=lambda: ["routed_experts", "shared_experts", "value_head"])
    """Parameter groups that train; the rest (attention, embeddings, norms) stay frozen.
    Groups: routed_experts, shared_experts, router, attention, embedding, norms, dense_mlp, value_head, all."""
    value_clip: float | None = None
    """Clip new values to old ± this (None disables)."""
    pretrain_steps: int = 0
    """Value pretraining steps on rollouts of the frozen initial policy before RL."""
    init_from: Literal["actor"] | str = "actor"
    """'actor' (copy actor trunk) or a path to a value checkpoint."""
    max_tokens_per_microbatch: int = 4096
    """Token budget per critic micro-batch."""
    recompute_granularity: Literal["none", "selective", "full"] = "none"
    """Activation recomputation of the critic."""


@cfg
class GaeConfig:
    """Token-level GAE on the critic's values: the advantage estimator of sao and ppo."""

    gamma: float = 1.0
    """Discount."""
    lam: float = 1.0
    """GAE lambda."""
    skip_observations: bool = True
    """Skip-observation token-level GAE (paper §3.2): observation tokens are not steps; false: plain token-level
    GAE, whose critic also trains on the observation steps between turns."""


@cfg
class GroupAdvantageConfig:
    """Group-normalised outcome advantages: the estimator of grpo and grpo_dis."""

    normalize_std: bool = True
    """Divide by the group's reward std (GRPO); false: R minus the group mean only."""


@cfg
class RunningMeanConfig:
    """Outcome minus a running-mean reward baseline: the estimator of sao_running_mean (the paper's ablation)."""

    momentum: float | None = 0.99
    """Exponential running mean with this momentum in [0, 1); null: the exact mean of every reward seen."""


@cfg
class DisConfig:
    """Direct double-sided importance sampling against the rollout log-probs: the loss of sao, grpo_dis,
    sao_running_mean."""

    eps_low: float = 0.3
    """Lower band: tokens with ratio < 1 - eps_low are masked (math 0.3, coding 0.8)."""
    eps_high: float = 5.0
    """Upper band: tokens with ratio > 1 + eps_high are masked (math 5.0, coding 3.0)."""


@cfg
class PpoClipConfig:
    """PPO's clipped surrogate: the loss of ppo (vs rollout log-probs) and grpo (vs the old policy)."""

    clip_low: float = 0.2
    """Lower clip: the ratio is clipped at 1 - clip_low."""
    clip_high: float = 0.28
    """Upper clip: the ratio is clipped at 1 + clip_high (DAPO's clip-higher)."""
    dual_clip: float | None = None
    """Dual-clip constant c (> 1) bounding the loss of negative advantages at -c * A; null disables."""


@cfg
class AlgorithmConfig:
    """RL objective: the shared knobs, and one section per advantage estimator and policy loss. A section
    the chosen objective does not use must keep its defaults (validation refuses a changed one)."""

    name: Literal["sao", "grpo", "grpo_dis", "ppo", "sao_running_mean"] = "sao"
    """sao: single rollout + DIS + critic; grpo: group advantages + PPO clip vs recomputed old log-probs;
    grpo_dis: group advantages + DIS; ppo: critic + clip vs rollout log-probs; sao_running_mean: DIS + running-mean
    baseline (table: sao_megatron/algorithms/objectives.py)."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    """Policy-loss aggregation over the global batch (every objective)."""
    group_size: int = 8
    """G: rollouts per prompt whenever samples come in groups (scheduler.mode group or sync; auto picks group
    for grpo and grpo_dis)."""
    gae: GaeConfig = field(default_factory=GaeConfig)
    """GAE knobs (sao, ppo)."""
    group: GroupAdvantageConfig = field(default_factory=GroupAdvantageConfig)
    """Group-advantage knobs (grpo, grpo_dis)."""
    running_mean: RunningMeanConfig = field(default_factory=RunningMeanConfig)
    """Running-mean baseline knobs (sao_running_mean)."""
    dis: DisConfig = field(default_factory=DisConfig)
    """DIS loss knobs (sao, grpo_dis, sao_running_mean)."""
    ppo_clip: PpoClipConfig = field(default_factory=PpoClipConfig)
    """PPO clip loss knobs (ppo, grpo)."""
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "gamma": "write algorithm.gae.gamma", "lam": "write algorithm.gae.lam",
        "gae": "algorithm.gae is a section now: write algorithm.gae.skip_observations: true (skip_observation) or "
               "false (token)",
        "eps_low": "write algorithm.dis.eps_low", "eps_high": "write algorithm.dis.eps_high",
        "clip_low": "write algorithm.ppo_clip.clip_low", "clip_high": "write algorithm.ppo_clip.clip_high",
        "dual_clip": "write algorithm.ppo_clip.dual_clip",
        "normalize_group_std": "write algorithm.group.normalize_std",
        "running_mean": "algorithm.running_mean is a section now: write algorithm.running_mean.momentum: 0.99 "
                        "(exponential) or null (exact)",
        "running_mean_momentum": "write algorithm.running_mean.momentum",
    }
    """Keys of the flat algorithm section before it was nested, with what to write now (read by the loader)."""


@cfg
class WeightSyncConfig:
    """How the weights wing (sao_megatron/weights) pushes each step's weights to the engines."""

    transport: Literal["disk", "distributed"] = "disk"
    """disk: safetensors parts + update_weights_from_disk; distributed: every owner sends its slice over SGLang
    update groups (NCCL on GPUs, gloo on CPU)."""
    bucket_mb: int = 512
    """Bucket size for streaming weights to the engines."""
    timeout_s: float = 300.0
    """Bound on every weight-sync call and group operation: a dead engine fails the sync, never hangs it."""
    verify: bool = True
    """Compare the engines' /weights_checker checksums with the export after the first sync of each layout."""
    overlap: bool = True
    """Push each step's weights in the background while the next step trains (docs/weight-publishing.md#overlap)."""
    format: Literal["unquantized", "fp8_block"] = "unquantized"
    """What a push sends: the trainer's weights as they are (bf16 on GPUs), or, for SGLang engines serving a
    block-FP8 checkpoint (DeepSeek-V3, GLM-5-FP8), float8 weights + 128x128 ``weight_scale_inv``."""

    MOVED_VALUES: ClassVar[dict[str, dict[str, str]]] = {"transport": {"nccl": "distributed"}}
    """Old spellings of a field's values, with the value to write now (read by the loader)."""


@cfg
class RolloutConfig:
    """Inference engines and how the trainer talks to them."""

    engine: Literal["embedded", "sglang"] = "embedded"
    """embedded: CPU engine started by the trainer; sglang: the SGLang servers at engine_urls, or without
    engine_urls num_engines real SGLang servers started by the trainer (docs/sglang.md)."""
    num_engines: int = 1
    """Engines the trainer starts (embedded, or sglang without engine_urls)."""
    engine_urls: list[str] = field(default_factory=list)
    """SGLang server URLs (engine=sglang); empty: start num_engines servers on this machine."""
    sglang_python: str | None = None
    """Python of SGLang's own venv for servers started here (None: $SAO_SGLANG_PYTHON); built and printed
    by `bash scripts/setup.sh --sglang`."""
    sglang_max_total_tokens: int = 16384
    """KV cache of SGLang servers started here, in tokens (--max-total-tokens); 0 leaves it to SGLang (free
    GPU memory; on CPU that is 58M tokens, 13.8 GB)."""
    router: Literal["builtin", "sglang_router"] = "builtin"
    """Data routing: built-in least-loaded sticky router, or the real sglang-router."""
    router_url: str | None = None
    """An already running sglang-router (None: start one when router=sglang_router)."""
    api_key: str | None = None
    """API key sent to the engines."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling."""
    top_k: int = -1
    """Top-k sampling (-1 disables)."""
    max_new_tokens: int = 64
    """Generation budget per turn."""
    request_timeout_s: float = 600.0
    """Timeout for one /generate request."""
    startup_timeout_s: float = 120.0
    """How long the trainer waits for external engines (rollout.engine=sglang) to answer /health."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How each step's weights reach the engines (the weights wing, sao_megatron/weights)."""
    routing_replay: bool = False
    """R3: engines return each token's routed experts and the actor's forward replays them (docs/routing-replay.md)."""
    engine_restart_budget: int = 3
    """Restarts allowed per engine per run (dead or hung, by the process that launched it); 0 never restarts."""
    no_engine_timeout_s: float = 600.0
    """With no healthy engine for this long the run checkpoints and stops with NoEngineError."""

    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "weight_sync": "rollout.weight_sync is a section now: write rollout.weight_sync.transport: distributed (or "
                       "disk); on the command line --set rollout.weight_sync.transport=distributed",
        "weight_sync_bucket_mb": "write rollout.weight_sync.bucket_mb",
        "weight_sync_timeout_s": "write rollout.weight_sync.timeout_s",
        "weight_sync_verify": "write rollout.weight_sync.verify",
        "overlap_weight_push": "write rollout.weight_sync.overlap",
        "engine_weight_format": "write rollout.weight_sync.format",
    }
    """Weight-push keys of the flat rollout section before they became rollout.weight_sync (read by the loader)."""


@cfg
class SchedulerConfig:
    """Asynchronous single-rollout scheduling."""

    mode: Literal["auto", "single", "group", "sync"] = "auto"
    """auto (from algorithm.name: group for grpo/grpo_dis, else single), single (SAO), group (GRPO groups of
    algorithm.group_size), sync (on-policy baseline)."""
    batch_size: int = 128
    """B: finished samples per training batch."""
    concurrency: int = 256
    """Episodes in flight against the engines."""
    max_staleness: int = 1
    """eta: admit while started <= (v+eta+1)*B; drop samples whose oldest token version < v-eta."""
    partial_rollout: Literal["retract", "abort", "discard"] = "retract"
    """What happens to in-flight generations on a weight update."""
    consume_order: Literal["fifo", "oldest_first", "wait_oldest"] = "wait_oldest"
    """Which finished samples a batch takes: fifo (finish order), oldest_first (oldest token version first,
    then finish order), wait_oldest (oldest_first, and wait for in-flight episodes that would be stale at
    the next batch: long responses are not dropped). fifo drops most long responses at eta=1
    (benchmarks/scheduler_stale.py, docs/algorithm-defaults.md)."""


@cfg
class RewardPhase:
    """One phase of a non-stationary reward schedule."""

    start_version: int = 0
    """Trainer version at which this phase starts."""
    target: str = ""
    """Task-specific target behaviour for the phase."""


@cfg
class DataConfig:
    """Prompts, environment and reward."""

    task: str = "arithmetic"
    """Task/environment name: arithmetic, calculator, math, code (see sao_megatron.envs)."""
    path: str | None = None
    """JSONL dataset; None uses the task's built-in generator (math and code have none: required)."""
    num_prompts: int = 4096
    """Prompts drawn from the generator (ignored with path)."""
    max_prompt_tokens: int = 64
    """Longest prompt; longer prompts are an error."""
    max_turns: int = 1
    """Turns per episode (multi-turn environments)."""
    max_total_tokens: int = 256
    """Budget for prompt + all turns."""
    reward_timeout_s: float = 10.0
    """Per-sample reward time limit; over it the reward is 0 with a logged reason."""
    reward_workers: int = 2
    """Reward worker processes."""
    phases: list[RewardPhase] = field(default_factory=list)
    """Non-stationary reward schedule (online learning); empty = stationary."""
    seed: int = 0
    """Seed for the generator and shuffling."""
    options: dict[str, int | float | str | bool] = field(default_factory=dict)
    """Task-specific options (e.g. math/code: chat_template, system_prompt, instruction; see the task's module)."""


@cfg
class CheckpointConfig:
    """Saving and resuming."""

    save_interval: int = 0
    """Save every N trainer steps (0: only at the end)."""
    keep_last: int = 2
    """Checkpoints kept (older ones deleted after a successful save)."""
    load: str | None = None
    """Checkpoint directory to start from (fresh run dir)."""
    async_save: bool = False
    """Write checkpoints in the background (megatron-core async dist-checkpointing): training continues
    while a forked writer saves; the checkpoint is published (manifest, ``latest``) once it finishes."""
    verify_checksums: bool = True
    """On resume, check every file's CRC-32 against the manifest (reads the checkpoint once, split across
    ranks); False checks the sizes only."""


@cfg
class LoggingConfig:
    """Metrics sinks."""

    wandb: bool = False
    """Log to Weights & Biases."""
    wandb_project: str = "sao-megatron"
    """wandb project."""
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    """wandb mode (offline on machines without network)."""
    tensorboard: bool = False
    """Write TensorBoard event files."""
    log_interval: int = 1
    """Console log every N steps."""


@cfg
class RunConfig:
    """The run as a whole."""

    num_steps: int = 10
    """Trainer steps (actor updates)."""
    seed: int = 1234
    """Global seed."""
    max_nan_steps: int = 3
    """Stop after this many consecutive non-finite losses (each one is skipped)."""
    sft_steps: int = 0
    """Optional supervised warm-up steps on task demonstrations before RL."""
    sft_lr: float = 1e-3
    """Learning rate of the supervised warm-up."""
    sft_batch_size: int = 64
    """Demonstrations per supervised warm-up step."""


@cfg
class EvalConfig:
    """Periodic evaluation on the task's held-out problems (never trained on)."""

    interval: int = 0
    """Evaluate every N trainer steps and after the last one (0: never during training)."""
    num_prompts: int = 128
    """Held-out problems per evaluation, one sample each (pass@1)."""
    temperature: float = 0.0
    """Sampling temperature of evaluation (0: greedy)."""
    before_train: bool = False
    """Also evaluate the starting weights once (after the warm-up and value pretraining, before the first
    RL step), logged with the first step as ``eval_start/*``: the baseline RL's held-out gain is measured
    from. Works with interval 0 too (only this evaluation). Skipped on resume."""


@cfg
class ResourcesConfig:
    """The cluster a run is laid out for: trainer GPUs and SGLang rollout servers (`sao-megatron plan`)."""

    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where the trainer runs: cuda (stops at start-up with the reason when CUDA is unusable), cpu (gloo, CPU
    shims, local specs), or auto (CUDA when usable, else the CPU with one warning line). Checked at start-up,
    never by config validation."""
    nodes: int = 1
    """Trainer nodes; actor and critic are colocated on all their GPUs (world = nodes * gpus_per_node)."""
    gpus_per_node: int = 8
    """GPUs per node (trainer and rollout nodes alike)."""
    gpu_mem_gb: float = 80.0
    """Memory per GPU in GiB (H100: 80, H200: 141)."""
    offload_idle_optimizer: bool = False
    """While actor or critic steps, the other's fp32 main params, Adam moments and grads wait in host memory."""
    rollout_nodes: int = 0
    """Nodes that run SGLang servers (0: no GPU engines, e.g. the embedded CPU engine)."""
    rollout_tp_size: int = 1
    """GPUs per SGLang server (its --tp-size); a multiple of gpus_per_node when a server spans nodes."""
    rollout_ep_size: int = 1
    """Expert parallelism inside a server (SGLang --ep-size); divides rollout_tp_size."""
    rollout_mem_fraction: float = 0.85
    """SGLang --mem-fraction-static: share of GPU memory for weights plus KV cache."""
    link_gbps: float = 400.0
    """Network bandwidth per GPU in Gb/s (weight-sync estimate of `sao-megatron plan`)."""


@cfg
class ExperimentConfig:
    """Root config: nests the components, nothing else."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model architecture."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Trainer parallel layout."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Actor training."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Critic training."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """RL objective."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Inference engines."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Asynchronous scheduling."""
    data: DataConfig = field(default_factory=DataConfig)
    """Tasks and rewards."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics sinks."""
    run: RunConfig = field(default_factory=RunConfig)
    """Run-level settings."""
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    """Cluster shape (nodes, GPUs, rollout servers) the layout is planned for."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation during training."""
