"""Actor and critic as trained objects: model chunks + DDP + optimizer + LR schedule."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from sao_megatron.config import ActorConfig, CriticConfig, ModelConfig
from sao_megatron.models.builder import build_model_chunks, count_parameters
from sao_megatron.models.critic import freeze_for_critic
from sao_megatron.training.step.optim import setup_optimizer

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(kw_only=True, slots=True)
class TrainedModel:
    """One trained Megatron model on this rank."""

    chunks: list[torch.nn.Module]
    """Model chunks (one, or one per virtual pipeline stage) — export and checkpoints use these."""
    ddp: list[Any]
    """The same chunks wrapped in Megatron DDP — training steps use these."""
    optimizer: Any
    """Megatron optimizer (plain or distributed). In bf16/fp16 it holds fp32 master weights copied when it
    was built: write weights only through ``set_weights``, or the first step brings the old ones back."""
    scheduler: Any
    """OptimizerParamScheduler (LR warm-up/decay)."""
    param_counts: dict[str, int]
    """Local parameter counts: total, trainable, frozen (and per group for the critic)."""

    def set_weights(self, write: Callable[[list[torch.nn.Module]], T]) -> T:
        """Collective when ``write`` is: the one way to write weights into a built model (an HF load, a
        model-only checkpoint load, the critic's copy of the actor). ``write(chunks)`` writes them, then the
        optimizer takes them as its master weights; returns what ``write`` returned.

        Megatron's bf16/fp16 optimizers copy fp32 master weights from the model when they are built and
        copy them back into the model after every step, so without the reload the first step would
        restore the build-time (random) weights. Megatron-LM's own model-only loads reload the same way.
        Not for loads that restore the optimizer state too (resume): their saved fp32 master weights are
        more precise than the model's rounded copy, and must win.
        """
        result = write(self.chunks)
        self.optimizer.reload_model_params()
        return result


def build_actor(model: ModelConfig, actor: ActorConfig, ctx, *, total_steps: int) -> TrainedModel:
    """The policy: Megatron chunks + DDP + optimizer + LR schedule over ``total_steps`` optimizer steps."""
    chunks = build_model_chunks(model, ctx, recompute=actor.recompute_granularity)
    counts = count_parameters(chunks)
    ddp, optimizer, scheduler = setup_optimizer(chunks, actor.optimizer, ctx, total_steps=total_steps)
    return TrainedModel(chunks=chunks, ddp=ddp, optimizer=optimizer, scheduler=scheduler, param_counts=counts)


def build_critic(model: ModelConfig, critic: CriticConfig, ctx, *, total_steps: int) -> TrainedModel:
    """Critic = actor trunk + value head, frozen per ``critic.trainable``. Its weights are set once the
    actor's starting weights are final (``training.run.components.initial_weights``)."""
    chunks = build_model_chunks(model, ctx, value_head=True, recompute=critic.recompute_granularity)
    counts = freeze_for_critic(chunks, critic.trainable)  # before DDP: frozen params get no grad/optim state
    counts |= {k: v for k, v in count_parameters(chunks).items() if k == "total"}
    # The critic takes K optimizer steps per actor step (and value pretraining steps).
    steps = total_steps * critic.num_updates_per_step + critic.pretrain_steps * critic.num_updates_per_step
    ddp, optimizer, scheduler = setup_optimizer(chunks, critic.optimizer, ctx, total_steps=steps)
    return TrainedModel(chunks=chunks, ddp=ddp, optimizer=optimizer, scheduler=scheduler, param_counts=counts)
