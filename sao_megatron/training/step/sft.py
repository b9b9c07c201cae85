"""Supervised warm-up on task demonstrations (Megatron actor, before RL).

A randomly initialised tiny model almost never emits a well-formed answer, so
RL would see zero reward for a long time. A short warm-up on demonstrations
teaches the answer format; RL then has to learn the rest. The warm-up uses the
actor's own optimizer with the learning rate set to ``run.sft_lr`` (the RL LR
schedule is not stepped), so Adam statistics carry over into RL.
"""

from __future__ import annotations

import logging
import random

from sao_megatron.config import ModelConfig, RunConfig
from sao_megatron.models.actor import token_logprobs
from sao_megatron.parallel.collectives import broadcast_object, rank0_call
from sao_megatron.scheduler.sample import demonstration_sample
from sao_megatron.training.step.batch import prepare_local_batch
from sao_megatron.training.step.optim import optimizer_step

log = logging.getLogger(__name__)


def demonstration_batch(task, rng: random.Random, batch_size: int):
    prompts = task.prompts()
    chosen = [prompts[rng.randrange(len(prompts))] for _ in range(batch_size)]
    return [demonstration_sample(p.input_ids, task.demonstration(p), task.demonstration_mask(p)) for p in chosen]


def supervised_warmup(actor, task, ctx, *, run: RunConfig, model: ModelConfig, max_tokens: int) -> list[float]:
    """``run.sft_steps`` cross-entropy steps on demonstrations; returns the loss per step.

    Collective: ``task`` is used on rank 0 (None elsewhere), which broadcasts each batch."""
    rng = random.Random(run.seed + 17)
    rank0 = ctx.rank == 0
    rank0_call(lambda: task.check_demonstrations())  # e.g. a dataset without solutions: stop every rank
    losses = []
    for step in range(run.sft_steps):
        samples = broadcast_object(demonstration_batch(task, rng, run.sft_batch_size) if rank0 else None)
        batch = prepare_local_batch(samples, ctx, max_tokens=max_tokens, vocab_size=model.vocab_size)

        def loss_fn(logits, mb):
            lp, _ = token_logprobs(logits, mb["tokens"], tp_group=ctx.tp_group, vocab_size=model.vocab_size,
                                   with_entropy=False)
            loss = -(lp * mb["action_mask"]).sum() / max(batch.num_tokens, 1)
            return loss, {"loss": loss.detach()}

        for group in actor.optimizer.param_groups:
            group["lr"] = run.sft_lr
        result = optimizer_step(actor.ddp, actor.optimizer, _NoStepScheduler(), batch.microbatches, loss_fn, ctx=ctx)
        losses.append(result.loss)
        if rank0 and (step % 10 == 0 or step == run.sft_steps - 1):
            log.info("supervised warm-up %d/%d: loss %.4f", step + 1, run.sft_steps, result.loss)
    actor.scheduler.step(increment=0)  # put the RL schedule's learning rate back
    return losses


class _NoStepScheduler:
    def step(self, increment: int = 1) -> None:
        """The RL LR schedule does not advance during the warm-up."""
