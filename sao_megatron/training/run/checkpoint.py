"""Megatron distributed checkpoints (torch_dist) of model chunks and optimizer, resharding on load.

Tensors are identified by their global sharded keys (layer numbers are global,
TP/EP/PP shards are described by offsets), so a checkpoint written with one
layout (TP2×EP2, PP2 with VPP, ...) loads into any other. The distributed
optimizer state is saved ``fully_reshardable`` for the same reason; it reshards
between layouts that agree on EP > 1 vs EP = 1 (Megatron's optimizer chain).

Every rank must call these collectively. Entry scripts need an
``if __name__ == "__main__":`` guard: saving starts a multiprocessing manager.

Files are CRC-32'd while they are written (``manifest.hashing_writes``); :class:`CheckpointSaves`
runs saves synchronously or with megatron-core's async dist-checkpointing, and runs the
publishing step (manifest, rename) only once the files are complete.
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedBase

from sao_megatron.training.run.manifest import hashing_writes

logger = logging.getLogger(__name__)

OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
"""Optimizer state in model space: reshards across TP/PP/EP/DP on load, with no per-layout key prefixes
(a chained dense+expert optimizer would otherwise prefix keys by its position in the chain)."""


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside a DDP (or other ``.module``) wrapper."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def _drop_keys(sharded: dict[str, Any], exclude: Sequence[str]) -> dict[str, Any]:
    """Remove entries whose checkpoint key starts with one of ``exclude`` (e.g. 'output_layer.')."""
    def keep(name: str, value: Any) -> bool:
        key = value.key if isinstance(value, ShardedBase) else name
        return not any(key.startswith(p) or name.startswith(p) for p in exclude)

    return {k: v for k, v in sharded.items() if keep(k, v)}


def sharded_model_state(model_chunks: Sequence[torch.nn.Module], exclude: Sequence[str] = ()) -> dict[str, Any]:
    n = len(model_chunks)
    return {_model_key(i, n): _drop_keys(_unwrap(c).sharded_state_dict(), exclude)
            for i, c in enumerate(model_chunks)}


def save_checkpoint(path: str | pathlib.Path, model_chunks: Sequence[torch.nn.Module], optimizer=None,
                    extra: dict[str, Any] | None = None, *, saves: CheckpointSaves | None = None) -> None:
    """Save model chunks (+ optimizer state, + ``extra``: rank-0 picklable objects) to a new directory.

    With ``saves`` in async mode the tensors are staged now (to host memory on GPU; on CPU the
    forked writer's copy-on-write snapshot) and written in the background from the next
    ``saves.then``: the files are complete only after ``saves.wait()`` / a ``saves.poll()`` that
    finalizes them.
    """
    path = pathlib.Path(path)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        if any(path.iterdir()):
            raise ValueError(f"checkpoint directory {path} is not empty: save into a fresh directory")
    dist.barrier()
    state: dict[str, Any] = sharded_model_state(model_chunks)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=False, metadata=OPTIMIZER_SHARDING)
    if extra is not None:
        state["extra"] = extra
    with hashing_writes():
        if saves is not None and saves.async_save:
            saves.add(dist_checkpointing.save(state, str(path), async_sharded_save=True,
                                              async_strategy="mcore"), path)
        else:
            dist_checkpointing.save(state, str(path))
            logger.info("saved checkpoint %s", path)
    dist.barrier()


class CheckpointSaves:
    """Checkpoint saves in flight, synchronous or asynchronous (``checkpoint.async_save``).

    Async mode uses megatron-core's own async dist-checkpointing (``async_strategy="mcore"``, a
    writer process forked per save; NVIDIA's resiliency extension is not a dependency). Megatron
    collects the writers' results through one queue per process, so two of its async saves must
    not overlap: the parts saved before ``then`` (actor, critic) are staged at once and written
    one after the other by a single forked writer. Collective: every rank calls
    ``add``/``then``/``poll``/``wait`` in the same order.
    """

    def __init__(self, *, async_save: bool):
        self.async_save = async_save
        self._queue = None
        self._batch: list[tuple[Any, ...]] = []
        self._last_idx = self._done_idx = -1
        self._then: list[tuple[int, Callable[[], None]]] = []

    def add(self, request, path: pathlib.Path) -> None:
        """Stage ``request``'s tensors now (D2H, inside the caller's ``resident`` block) and queue its write."""
        args = list(request.async_fn_args)
        if request.preload_fn is not None:  # megatron's contract: argument 1 is the write buckets
            args[1] = request.preload_fn()
        self._batch.append((request.async_fn, tuple(args), dict(request.async_fn_kwargs),
                            [*request.finalize_fns, lambda: logger.info("saved checkpoint %s (async)", path)]))

    def _flush(self) -> None:
        """Fork one writer for the staged parts (it inherits the hashing hook)."""
        if not self._batch:
            return
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest

        batch, self._batch = self._batch, []

        def write_all() -> None:
            for fn, args, kwargs, _ in batch:
                if fn is not None:
                    fn(*args, **kwargs)

        if self._queue is None:
            self._queue = AsyncCallsQueue(persistent=False)  # forked per save, not a spawned worker
        request = AsyncRequest(write_all, (), [fin for *_, fins in batch for fin in fins])
        with hashing_writes():
            self._last_idx = self._queue.schedule_async_request(request)

    @property
    def pending(self) -> int:
        return 0 if self._queue is None else self._queue.get_num_unfinalized_calls()

    def then(self, fn: Callable[[], None]) -> None:
        """Start writing the parts added so far; run collective ``fn`` once every save has finished
        (now if none is pending)."""
        self._flush()
        if self.pending == 0:
            fn()
        else:
            self._then.append((self._last_idx, fn))

    def poll(self, *, blocking: bool = False) -> None:
        """Finalize the saves that finished (all of them, waiting, with ``blocking``); run their ``then``."""
        self._flush()
        if self._queue is None:
            return
        done = self._queue.maybe_finalize_async_calls(blocking=blocking)
        self._done_idx = max([self._done_idx, *done])
        while self._then and self._then[0][0] <= self._done_idx:
            self._then.pop(0)[1]()

    def wait(self) -> None:
        self.poll(blocking=True)


def load_checkpoint(path: str | pathlib.Path, model_chunks: Sequence[torch.nn.Module], optimizer=None, *,
                    exclude: Sequence[str] = ()) -> dict[str, Any] | None:
    """Load into the model chunks (any layout) and the optimizer; returns the saved ``extra``.

    ``exclude``: checkpoint key prefixes left out (e.g. ``("output_layer.",)`` to initialise a
    critic from an actor checkpoint); those parameters keep their current values.
    """
    path = pathlib.Path(path)
    if not (path / "metadata.json").exists():
        raise ValueError(f"{path} is not a Megatron distributed checkpoint (no metadata.json)")
    state: dict[str, Any] = sharded_model_state(model_chunks, exclude)
    if optimizer is not None:
        _ensure_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=OPTIMIZER_SHARDING)
    loaded = dist_checkpointing.load(state, str(path))
    n = len(model_chunks)
    for i, chunk in enumerate(model_chunks):
        missing, unexpected = _unwrap(chunk).load_state_dict(loaded[_model_key(i, n)], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")
                   and not any(k.startswith(p) for p in exclude)]
        if missing or unexpected:
            raise ValueError(f"checkpoint {path} does not match the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    if optimizer is not None:
        try:
            optimizer.load_state_dict(loaded["optimizer"])
        except (KeyError, RuntimeError) as exc:
            raise ValueError(
                f"could not load the optimizer state in {path}: {exc!r}. If the checkpoint was written with "
                "another layout: Megatron keeps expert parameters in a separate optimizer only when "
                "expert_model_parallel_size > 1, so optimizer state reshards only between layouts that both "
                "have EP > 1 or both EP = 1; load the model alone (optimizer=None) to switch.") from exc
    logger.info("loaded checkpoint %s", path)
    return loaded.get("extra")


def _ensure_optimizer_state(optimizer) -> None:
    """Give a never-stepped optimizer zero Adam state with a ``step`` entry.

    Without apex/TE, Megatron's DistributedOptimizer.state_dict() reads ``step`` from the
    torch Adam state, which only exists after a first step (and its init_state_fn adds none):
    loading into a fresh optimizer (resume, reshard) would fail on an assertion.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        init = getattr(sub, "init_state_fn", None)
        # Only torch's own Adam keeps `step` in the state (TE/apex fused Adam keep it in param groups).
        if type(inner) not in (torch.optim.Adam, torch.optim.AdamW) or init is None or len(inner.state):
            continue
        init(inner, sub.config)
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.tensor(0.0))


def publish_checkpoint(part_dir: str | pathlib.Path, commit: Callable[[], Any]) -> None:
    """Collective, once the files of ``part_dir`` are complete (``CheckpointSaves.then``): rank 0
    writes ``manifest.json`` (the last file) and publishes the directory with ``commit``."""
    if dist.get_rank() == 0:
        from sao_megatron.training.run.manifest import write_manifest

        manifest = write_manifest(part_dir)
        final = commit()
        logger.info("checkpoint %s: %d files, %.1f MB", final or part_dir, len(manifest["files"]),
                    manifest["total_bytes"] / 1e6)
    dist.barrier()


def verify_checkpoint(path: str | pathlib.Path, *, checksums: bool = True) -> None:
    """Collective: raise ``CorruptCheckpointError`` naming the files of ``path`` that do not match its
    manifest. Each rank checks the sizes and CRCs of its share of the files."""
    from sao_megatron.training.run.manifest import check_checkpoint

    def gather(problems: list[str]) -> list[str]:
        everyone: list[list[str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, problems)
        return list(dict.fromkeys(p for ps in everyone for p in ps or []))

    check_checkpoint(path, checksums=checksums, gather=gather, rank=dist.get_rank(),
                     world_size=dist.get_world_size())
