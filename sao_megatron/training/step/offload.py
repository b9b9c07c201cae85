"""``resources.offload_idle_optimizer``: only the model that is stepping keeps its optimizer on the GPU.

Actor and critic are colocated on the same GPUs and take turns: while one steps, the other's fp32
main params, Adam moments and gradient buffers are idle. With the option on, each model's
optimizer state waits in host memory and its gradient buffers are freed, except inside a
``resident`` block (its updates, checkpoint saves and loads). Megatron-core's own RL hooks do the
moves (``MegatronOptimizer.offload_to_cpu/restore_from_cpu``, ``DistributedDataParallel.
offload_grad_buffers/restore_grad_buffers``); the bf16 weights used by forward passes and weight
sync never move. The planner (``sao-megatron plan``) counts only the weights of the idle model.

On CPU the optimizer moves are no-ops (the state is already in host memory); the gradient
buffers are freed and reallocated all the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def park(model: Any, *, offload: bool) -> None:
    """Move ``model``'s optimizer state to host memory and free its gradient buffers (when ``offload``)."""
    if not offload:
        return
    for chunk in model.ddp:
        chunk.offload_grad_buffers(synchronize=True, empty_cache=False)
    model.optimizer.offload_to_cpu()  # also empties the CUDA cache


@contextlib.contextmanager
def resident(model: Any, *, offload: bool) -> Iterator[None]:
    """Inside: ``model`` (a ``TrainedModel``) has its optimizer state and zeroed gradient buffers on
    the device. Outside, with ``offload``, they are parked again (also when the block raises)."""
    if not offload:
        yield
        return
    model.optimizer.restore_from_cpu()
    for chunk in model.ddp:
        chunk.restore_grad_buffers(synchronize=False)
    try:
        yield
    finally:
        park(model, offload=True)


def grad_buffer_bytes(model: Any) -> int:
    """Bytes held by ``model``'s gradient buffers right now (0 while parked)."""
    return sum(buf.grad_data.untyped_storage().nbytes()
               for chunk in model.ddp for buf in chunk.buffers + chunk.expert_parallel_buffers)
