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

from sao_megatron.models.actor import token_logprobs
from sao_megatron.scheduler.sample import collate, demonstration_sample
from sao_megatron.training import rl_step
from sao_megatron.training.collectives import broadcast_object, rank0_call

log = logging.getLogger(__name__)


def demonstration_batch(task, rng: random.Random, batch_size: int):
    prompts = task.prompts()
    chosen = [prompts[rng.randrange(len(prompts))] for _ in range(batch_size)]
    return [demonstration_sample(p.input_ids, task.demonstration(p), task.demonstration_mask(p)) for p in chosen]


def supervised_warmup(trainer) -> list[float]:
    """``run.sft_steps`` cross-entropy steps on demonstrations; returns the loss per step."""
    cfg, ctx, actor = trainer.cfg, trainer.ctx, trainer.actor
    rng = random.Random(cfg.run.seed + 17)
    rank0_call(lambda: trainer.task.check_demonstrations())  # e.g. a dataset without solutions: stop every rank
    losses = []
    for step in range(cfg.run.sft_steps):
        samples = broadcast_object(demonstration_batch(trainer.task, rng, cfg.run.sft_batch_size)
                                   if trainer.rank0 else None)
        full = collate(samples, pad_to_multiple=ctx.tp_size)
        batch = rl_step.build_local_batch(full, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size,
                                          max_tokens=cfg.actor.max_tokens_per_microbatch, pad_multiple=ctx.tp_size)

        def loss_fn(logits, mb):
            lp, _ = token_logprobs(logits, mb["tokens"], tp_group=ctx.tp_group, vocab_size=cfg.model.vocab_size,
                                   with_entropy=False)
            loss = -(lp * mb["action_mask"]).sum() / max(batch.num_tokens, 1)
            return loss, {"loss": loss.detach()}

        for group in actor.optimizer.param_groups:
            group["lr"] = cfg.run.sft_lr
        result = rl_step.guarded_step(actor.ddp, actor.optimizer, _NoStepScheduler(), batch.microbatches,
                                      loss_fn, ctx=ctx)
        losses.append(result.loss)
        if trainer.rank0 and (step % 10 == 0 or step == cfg.run.sft_steps - 1):
            log.info("supervised warm-up %d/%d: loss %.4f", step + 1, cfg.run.sft_steps, result.loss)
    actor.scheduler.step(increment=0)  # put the RL schedule's learning rate back
    return losses


class _NoStepScheduler:
    def step(self, increment: int = 1) -> None:
        """The RL LR schedule does not advance during the warm-up."""
