"""Megatron DDP + optimizer (plain or distributed) + LR schedule, for actor and critic alike.

Freeze parameters (``requires_grad=False``) BEFORE calling ``setup_optimizer``:
DDP then allocates no gradient buffer for them and the optimizer keeps no state.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.utils import get_model_config

from sao_megatron.config.schema import OptimizerConfig
from sao_megatron.training.forward import LossFn, MicroBatch, forward_backward

if TYPE_CHECKING:
    from sao_megatron.training.distributed import ParallelContext


@dataclasses.dataclass(kw_only=True, slots=True)
class StepResult:
    """Outcome of one optimizer step."""

    metrics: list[dict[str, torch.Tensor]]
    """loss_fn metrics per micro-batch (last pipeline stage; [] elsewhere)."""
    update_successful: bool
    """False when the step was skipped (non-finite gradients with fp16 loss scaling)."""
    grad_norm: float | None
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate used for this step."""


def megatron_optimizer_config(opt: OptimizerConfig, params_dtype: torch.dtype,
                              use_distributed_optimizer: bool) -> MegatronOptimizerConfig:
    """Our OptimizerConfig (Megatron field names) -> Megatron's; Adam with fp32 master weights."""
    return MegatronOptimizerConfig(
        optimizer="adam", lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps, clip_grad=opt.clip_grad,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16, params_dtype=params_dtype,
        use_distributed_optimizer=use_distributed_optimizer)


def wrap_ddp(model_chunks: Sequence[torch.nn.Module], ctx: ParallelContext) -> list[DistributedDataParallel]:
    """Megatron DDP per chunk; only the first chunk buckets (overlap is off, one bucket set suffices)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        use_distributed_optimizer=ctx.parallel.use_distributed_optimizer)
    wrapped = [DistributedDataParallel(config=get_model_config(c), ddp_config=ddp_config, module=c,
                                       disable_bucketing=i > 0, pg_collection=ctx.pg)
               for i, c in enumerate(model_chunks)]
    config = get_model_config(model_chunks[0])
    config.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    config.finalize_model_grads_func = functools.partial(_finalize_grads, pg_collection=ctx.pg)
    return wrapped


def _finalize_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False, **_):
    # Megatron would divide by the token count it summed from loss_fn (1 per micro-batch here):
    # our losses are already normalised (training.forward), so pass no count.
    finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)


def build_scheduler(optimizer, opt: OptimizerConfig, *, total_steps: int) -> OptimizerParamScheduler:
    """Linear warm-up from 0 then constant / linear / cosine decay to ``min_lr`` at ``total_steps``."""
    if opt.lr_warmup_steps >= max(total_steps, 1) and opt.lr_decay_style != "constant":
        raise ValueError(f"lr_warmup_steps={opt.lr_warmup_steps} must be below the number of steps {total_steps}")
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if opt.lr_warmup_steps else opt.lr, max_lr=opt.lr, min_lr=opt.min_lr,
        lr_warmup_steps=opt.lr_warmup_steps, lr_decay_steps=max(total_steps, opt.lr_warmup_steps + 1),
        lr_decay_style=opt.lr_decay_style, start_wd=opt.weight_decay, end_wd=opt.weight_decay,
        wd_incr_steps=max(total_steps, 1), wd_incr_style="constant")


def setup_optimizer(model_chunks: Sequence[torch.nn.Module], opt: OptimizerConfig, ctx: ParallelContext, *,
                    total_steps: int) -> tuple[list[DistributedDataParallel], object, OptimizerParamScheduler]:
    """DDP-wrap the chunks and build Megatron's optimizer and LR scheduler.

    Returns (ddp_chunks, optimizer, scheduler). Train with the ddp_chunks from here on.
    """
    config = get_model_config(model_chunks[0])
    ddp_chunks = wrap_ddp(model_chunks, ctx)
    optimizer = get_megatron_optimizer(
        megatron_optimizer_config(opt, config.params_dtype, ctx.parallel.use_distributed_optimizer), ddp_chunks)
    if config.fp16:
        config.grad_scale_func = optimizer.scale_loss
    return ddp_chunks, optimizer, build_scheduler(optimizer, opt, total_steps=total_steps)


def zero_grads(ddp_chunks: Sequence[DistributedDataParallel], optimizer) -> None:
    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


def train_step(ddp_chunks: Sequence[DistributedDataParallel], optimizer, scheduler: OptimizerParamScheduler,
               microbatches: Sequence[MicroBatch], loss_fn: LossFn, *, ctx: ParallelContext) -> StepResult:
    """Zero grads, forward/backward all micro-batches, clip, step optimizer and LR schedule."""
    for chunk in ddp_chunks:
        chunk.train()
    zero_grads(ddp_chunks, optimizer)
    metrics = forward_backward(ddp_chunks, microbatches, loss_fn, ctx=ctx)
    lr = optimizer.param_groups[0]["lr"]
    ok, grad_norm, _ = optimizer.step()
    if ok:
        scheduler.step(increment=1)
    return StepResult(metrics=metrics, update_successful=bool(ok), lr=float(lr),
                      grad_norm=None if grad_norm is None else float(grad_norm))
