"""Megatron DDP + optimizer (plain or distributed) + LR schedule, for actor and critic alike.

Freeze parameters (``requires_grad=False``) BEFORE calling ``setup_optimizer``:
DDP then allocates no gradient buffer for them and the optimizer keeps no state.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.utils import get_model_config

from sao_megatron.config.schema import OptimizerConfig
from sao_megatron.errors import SaoError
from sao_megatron.training.step.forward import LossFn, MicroBatchLike, forward_backward

if TYPE_CHECKING:
    from sao_megatron.parallel.bootstrap import ParallelContext

log = logging.getLogger(__name__)


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
    # our losses are already normalised (training.step.forward), so pass no count.
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
    from sao_megatron.parallel.cpu_support import apply_optimizer_shims

    apply_optimizer_shims()  # torch AdamW without TE/apex, on CUDA too: resume needs its `step` shim
    config = get_model_config(model_chunks[0])
    ddp_chunks = wrap_ddp(model_chunks, ctx)
    optimizer = get_megatron_optimizer(
        megatron_optimizer_config(opt, config.params_dtype, ctx.parallel.use_distributed_optimizer), ddp_chunks)
    if config.fp16:
        config.grad_scale_func = optimizer.scale_loss
    return ddp_chunks, optimizer, build_scheduler(optimizer, opt, total_steps=total_steps)


def reset_optimizer_state(optimizer) -> None:
    """Forget Adam's moments and step counts: the next step is a never-stepped optimizer's first (torch
    Adam creates its state lazily), so a warm-up's gradient statistics do not scale RL's first steps."""
    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(sub, "optimizer", sub)
        inner.state.clear()
        for group in inner.param_groups:
            if "step" in group:  # fused Adams keep the step count in the group
                group["step"] = 0


def zero_grads(ddp_chunks: Sequence[DistributedDataParallel], optimizer) -> None:
    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


@dataclasses.dataclass(kw_only=True, slots=True)
class UpdateResult:
    """What one optimizer step did."""

    applied: bool
    """False when the step was skipped (non-finite loss or gradients, or a loss-scaler skip)."""
    loss: float
    """Global objective value (summed over micro-batches and DP ranks); NaN when the loss was not finite."""
    grad_norm: float | None
    """Gradient norm before clipping (None when skipped)."""
    lr: float
    """Learning rate of this step."""
    outputs: list[dict[str, torch.Tensor]]
    """loss_fn outputs per micro-batch on the last pipeline stage ([] elsewhere)."""
    scaler_skip: bool = False
    """fp16 only: the dynamic loss scaler found inf/NaN gradients at a finite loss and lowered the
    scale. Expected during warm-up by design, so not counted as a non-finite step."""
    update_norm: float | None = None
    """Norm of this rank's parameter change over the batch's steps (``actor.log_update_norm``; else None)."""


def uses_loss_scaler(optimizer) -> bool:
    """True for fp16 optimizers (a constant or dynamic grad scaler skips steps on overflow)."""
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return any(getattr(o, "grad_scaler", None) is not None for o in parts)


def optimizer_step(ddp_chunks: Sequence[DistributedDataParallel], optimizer, scheduler,
                   microbatches: Sequence[MicroBatchLike], loss_fn: LossFn, *, ctx: ParallelContext) -> UpdateResult:
    """The one training step: zero grads, forward/backward every micro-batch, clip, step the optimizer
    and (when applied) the LR schedule. Skipped on every rank if any rank saw a non-finite loss.

    Used by the RL update, value pretraining, the supervised warm-up and ``models smoke``.
    """
    for chunk in ddp_chunks:
        chunk.train()
    zero_grads(ddp_chunks, optimizer)
    outputs = forward_backward(ddp_chunks, microbatches, loss_fn, ctx=ctx)
    local = sum(float(o["loss"]) for o in outputs) if outputs else 0.0
    finite = math.isfinite(local)
    # On ctx.device: NCCL reduces device tensors only.
    stat = torch.tensor([local if finite else 0.0, 0.0 if finite else 1.0], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(stat)  # loss contributions come from last-stage ranks only; TP ranks repeat them
    total, bad = float(stat[0]) / max(ctx.tp_size, 1), float(stat[1]) > 0
    lr = float(optimizer.param_groups[0]["lr"]) if optimizer.param_groups else 0.0
    if bad:
        zero_grads(ddp_chunks, optimizer)
        return UpdateResult(applied=False, loss=float("nan"), grad_norm=None, lr=lr, outputs=outputs)
    ok, grad_norm, _ = optimizer.step()
    scaler_skip = not ok and uses_loss_scaler(optimizer)
    if ok and grad_norm is not None and not math.isfinite(float(grad_norm)):
        ok = False
    if ok:
        scheduler.step(increment=1)
    return UpdateResult(applied=bool(ok), loss=total, lr=lr, outputs=outputs, scaler_skip=scaler_skip,
                        grad_norm=None if grad_norm is None else float(grad_norm))


class NonFiniteGuard:
    """Counts consecutive steps skipped for non-finite losses/gradients (not loss-scaler skips)."""

    def __init__(self, max_steps: int, streak: int = 0):
        self.max_steps, self.streak = max_steps, streak

    def record(self, result: UpdateResult, step: int) -> None:
        """NonFiniteLossError once ``max_steps`` consecutive steps were non-finite."""
        if result.applied or result.scaler_skip:
            if result.scaler_skip:
                log.info("step %d: fp16 loss scaler skipped the update (overflow; scale lowered)", step)
            self.streak = 0
            return
        self.streak += 1
        log.warning("step %d: non-finite loss or gradients, update skipped (%d in a row)", step, self.streak)
        if self.streak >= self.max_steps:
            raise NonFiniteLossError(f"{self.streak} consecutive steps had non-finite losses/gradients; lower "
                                     "the learning rate or check rewards/log-probs (run.max_nan_steps)")


class NonFiniteLossError(SaoError):
    """Too many consecutive steps had a non-finite loss."""
