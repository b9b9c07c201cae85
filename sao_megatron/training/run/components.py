"""Assembly: every trainer-side component built from its own config section, in one place.

``build_components(cfg)`` is the one function that turns an ``ExperimentConfig`` into the
parts a run needs (parallel context, task, actor, critic, baseline, weight exporter), and
resolves what the config leaves open (``scheduler.mode: auto``) without mutating the config.
The trainer, the supervised warm-up, the parity gate and the converters' checks all start here.
"""

from __future__ import annotations

import logging
import pathlib
from dataclasses import dataclass

from sao_megatron.algorithms.advantages import RunningMeanBaseline
from sao_megatron.algorithms.objectives import Objective, objective
from sao_megatron.config import AlgorithmConfig, ExperimentConfig, ModelConfig
from sao_megatron.config.validate import resolved_mode
from sao_megatron.envs import build_task
from sao_megatron.envs.base import Task
from sao_megatron.models.families import get_family
from sao_megatron.parallel.bootstrap import ParallelContext, init_distributed
from sao_megatron.parallel.collectives import rank0_call
from sao_megatron.weights.export import ExportPlan, drain, export_weights
from sao_megatron.training.run.models import TrainedModel, build_actor, build_critic

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Components:
    """The trainer-side parts of one run on this rank."""

    ctx: ParallelContext
    """Ranks, sizes, process groups and the device."""
    objective: Objective
    """What ``algorithm.name`` needs (critic, groups, estimator, loss)."""
    mode: str
    """scheduler.mode with ``auto`` resolved: single | group | sync."""
    task: Task | None
    """Prompts, tokenizer, rewards (rank 0, which owns the rollout side; None elsewhere)."""
    actor: TrainedModel
    """The policy (Megatron chunks + DDP + optimizer + LR schedule)."""
    critic: TrainedModel | None
    """The value model, when the objective needs one (and it was asked for)."""
    baseline: RunningMeanBaseline | None
    """The running-mean baseline of ``sao_running_mean``."""
    exporter: ExportPlan
    """The actor's weights as Hugging Face tensors (weight sync, parity, exports)."""

    def models(self) -> dict[str, TrainedModel | None]:
        """What a checkpoint holds, by directory name."""
        return {"actor": self.actor, "critic": self.critic}


def build_components(cfg: ExperimentConfig, *, with_critic: bool = True) -> Components:
    """Collective: build everything from ``cfg``. ``with_critic=False`` skips the critic even when the
    objective has one (the parity gate and the supervised warm-up need only the policy)."""
    ctx = init_distributed(cfg.parallel, seed=cfg.run.seed, device=cfg.resources.device)
    obj = objective(cfg.algorithm.name)
    task = rank0_call(lambda: build_task(cfg.data, model=cfg.model))  # bad datasets stop every rank here
    steps = cfg.run.num_steps
    # The actor's LR schedule advances once per optimizer step: ppo_epochs x num_minibatches per batch.
    actor = build_actor(cfg.model, cfg.actor, ctx, total_steps=steps * cfg.actor.ppo_epochs * cfg.actor.num_minibatches)
    if cfg.rollout.routing_replay:  # the actor only: the critic routes with its own router (docs/routing-replay.md)
        from sao_megatron.models.routing_replay import attach_route_replay

        attach_route_replay(actor.chunks, ctx)
    critic = build_critic(cfg.model, cfg.critic, ctx, total_steps=steps) if obj.critic and with_critic else None
    exporter = ExportPlan(actor.chunks, get_family(cfg.model.family).weight_map(cfg.model),
                          bucket_bytes=cfg.rollout.weight_sync.bucket_mb << 20)
    _log_choices(cfg, ctx, actor)
    return Components(ctx=ctx, objective=obj, mode=resolved_mode(cfg), task=task, actor=actor, critic=critic,
                      baseline=build_baseline(cfg.algorithm), exporter=exporter)


def build_baseline(alg: AlgorithmConfig) -> RunningMeanBaseline | None:
    """The paper's running-mean baseline (``algorithm.running_mean.momentum``: exponential, or null for the
    exact mean of every reward seen) for objectives whose estimator uses one."""
    if objective(alg.name).advantages.section != "running_mean":
        return None
    return RunningMeanBaseline(momentum=alg.running_mean.momentum)


def _log_choices(cfg: ExperimentConfig, ctx: ParallelContext, actor: TrainedModel) -> None:
    """One line that says what was chosen and why (specs, optimizer, device)."""
    if ctx.rank != 0:
        return
    from sao_megatron.models.specs import transformer_engine_usable

    te = transformer_engine_usable(ctx.device)
    opt = "distributed" if cfg.parallel.use_distributed_optimizer else "plain"
    log.info("models: %s specs (%s), %s Adam optimizer, %s params on %s; actor %s parameters on rank 0",
             "Transformer Engine" if te else "Megatron local",
             "TE importable on CUDA" if te else "Transformer Engine absent or no CUDA",
             opt, cfg.model.params_dtype, ctx.device, f"{actor.param_counts['total']:,}")


def initial_weights(c: Components, cfg: ExperimentConfig) -> None:
    """Collective: the starting weights of a fresh run. The actor from ``actor.load`` (Megatron
    checkpoint) or ``model.hf_dir`` (HF checkpoint), then the supervised warm-up (``run.sft_steps``) and,
    with ``actor.reset_optimizer_before_rl``, a fresh Adam state for RL; the critic once, from the final
    starting actor or ``critic.init_from``. Every write goes through ``TrainedModel.set_weights``, so the
    optimizers' master weights start from these weights, not from the random ones they were built with."""
    from sao_megatron.training.run.checkpoint import load_checkpoint

    if cfg.actor.load:
        c.actor.set_weights(lambda chunks: load_checkpoint(cfg.actor.load, chunks))
    elif cfg.model.hf_dir:
        from sao_megatron.models.families.sharded import load_hf_dir

        c.actor.set_weights(lambda chunks: load_hf_dir(chunks, cfg.model, cfg.model.hf_dir))
    if cfg.run.sft_steps:
        from sao_megatron.training.step.sft import supervised_warmup

        supervised_warmup(c.actor, c.task, c.ctx, run=cfg.run, model=cfg.model,
                          max_tokens=cfg.actor.max_tokens_per_microbatch)
    if cfg.actor.reset_optimizer_before_rl:
        from sao_megatron.training.step.optim import reset_optimizer_state

        reset_optimizer_state(c.actor.optimizer)
    if c.critic is None:
        return
    if cfg.critic.init_from != "actor":
        c.critic.set_weights(lambda chunks: load_checkpoint(cfg.critic.init_from, chunks))
    else:
        from sao_megatron.models.critic import init_critic_from_actor

        c.critic.set_weights(lambda chunks: init_critic_from_actor(chunks, c.actor.chunks))


def write_hf_export(c: Components, model: ModelConfig, out_dir: pathlib.Path, template_dir: pathlib.Path) -> None:
    """Collective: the actor's weights as a loadable HF directory (safetensors + config.json + the
    task's tokenizer) written by rank 0, exactly as the trainer syncs them to the engines."""
    from sao_megatron.models.families import write_hf_template
    from sao_megatron.weights.disk import write_hf_safetensors

    gen = export_weights(c.exporter)

    def write() -> None:
        try:
            template = write_hf_template(model, getattr(c.task, "tokenizer", None), template_dir)
            write_hf_safetensors(gen, out_dir, template_dir=template)
        finally:
            drain(gen)

    rank0_call(write, others=lambda: drain(gen))
