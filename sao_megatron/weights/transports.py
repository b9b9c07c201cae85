"""Which transport carries a push (``rollout.weight_sync.transport``), and the FP8 block wrapper.

``build_weight_sync(rollout_cfg, ...)`` is the one place that picks the transport:
- ``disk`` (``weights.disk.DiskWeightSync``): safetensors on a shared file system, loaded by every
  engine with ``/update_weights_from_disk``;
- ``distributed`` (``nccl`` accepted as an alias; ``weights.distributed.DistributedWeightSync``):
  SGLang's update groups, every owner of a slice sending it.

Both are called the same way on every trainer rank (``collective=True``) with this rank's share of the
export (``weights.export.iter_owned_hf_tensors``): ``connect(engine_urls, is_sender=...)`` once,
``stage(owned, version)`` per push (a ``weights.staged.Staged`` to deliver) or ``push(owned, version,
paused=...)`` for both at once, ``reconnect(url)`` for a restarted engine, ``close()``. With
``collective=False`` a disk sync runs in rank 0 alone (a rank-0 stream).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch

from sao_megatron.config.schema import RolloutConfig, WeightSyncConfig
from sao_megatron.weights.disk import DiskWeightSync
from sao_megatron.weights.distributed import DistributedWeightSync
from sao_megatron.weights.fp8_block import engine_scheme, requantize
from sao_megatron.weights.staged import Paused, Staged
from sao_megatron.weights.verify import WeightSyncError

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightSync(Protocol):
    """What the trainer calls on every rank (see the module docstring)."""

    def connect(self, engine_urls: list[str] | None, *, is_sender: bool) -> None: ...

    def push(self, owned: NamedTensors, version: int, *, paused: Paused | None = None,
             verify: bool = False) -> dict[str, float]: ...

    def stage(self, owned: NamedTensors, version: int, **how: Any) -> Staged: ...

    def reconnect(self, engine_url: str | None, new_url: str | None = None) -> None: ...

    def close(self) -> None: ...


def build_weight_sync(rollout_cfg, *, client, run_dir: str | Path, template_dir: str | Path | None,
                      collective: bool = True, world_group=None, checkpoint_dtype: str | None = None) -> WeightSync:
    """The transport ``rollout_cfg.weight_sync.transport`` names, wrapped for ``weight_sync.format: fp8_block``.

    ``client``: rank 0's RolloutClient (None on the other ranks). ``collective``: every trainer
    rank calls the sync (required by ``distributed``); False runs a disk sync on rank 0 alone.
    ``checkpoint_dtype``: the export's ``torch_dtype`` (how SGLang's ``--dtype auto`` holds it).
    """
    sync = _build_transport(rollout_cfg, client=client, run_dir=run_dir, template_dir=template_dir,
                            collective=collective, world_group=world_group, checkpoint_dtype=checkpoint_dtype)
    return Fp8BlockSync(sync) if rollout_cfg.weight_sync.format == "fp8_block" else sync


class Fp8BlockSync:
    """A transport whose pushes send block-FP8 weights (``fp8_weights.requantize``) for FP8-serving engines,
    quantized as the engines' own ``quantization_config`` says (read at ``connect``)."""

    def __init__(self, inner: WeightSync, scheme=None):
        self.inner, self.scheme = inner, scheme

    def connect(self, engine_urls: list[str] | None, *, is_sender: bool) -> None:
        self.inner.connect(engine_urls, is_sender=is_sender)
        found = None
        if engine_urls:  # rank 0: the checkpoint the engines serve (they all serve the same one)
            try:
                found = engine_scheme(self.inner.http.get(engine_urls[0].rstrip("/") + "/model_info").json())
            except (ValueError, httpx.HTTPError) as exc:
                found = f"{engine_urls[0]}: {exc}"
        found = self.inner.world.bcast(found)
        if isinstance(found, str):
            raise WeightSyncError(found)
        self.scheme = found

    def push(self, owned: NamedTensors, version: int, *, paused: Paused | None = None,
             verify: bool = False) -> dict[str, float]:
        if self.scheme is None:
            raise WeightSyncError("Fp8BlockSync.push before connect: the engines' quantization_config is not known")
        return self.inner.push(requantize(owned, self.scheme), version, paused=paused, verify=verify)

    def stage(self, owned: NamedTensors, version: int, **how: Any) -> Staged:
        """Quantized here, on the staging (training) thread: a snapshot holds what the engines load, and
        half the bytes."""
        if self.scheme is None:
            raise WeightSyncError("Fp8BlockSync.stage before connect: the engines' quantization_config is not known")
        return self.inner.stage(requantize(owned, self.scheme), version, **how)

    def reconnect(self, engine_url: str | None, new_url: str | None = None) -> None:
        self.inner.reconnect(engine_url, new_url)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str):  # transport-specific extras (failed_engines, ...)
        return getattr(self.inner, name)


def _build_transport(rollout_cfg: RolloutConfig, *, client, run_dir, template_dir, collective, world_group,
                     checkpoint_dtype) -> WeightSync:
    ws: WeightSyncConfig = rollout_cfg.weight_sync
    strict = rollout_cfg.engine == "embedded"  # it names every tensor as weight_check.held_name does
    held = dict(strict_names=strict, checkpoint_dtype=checkpoint_dtype, quantized=ws.format == "fp8_block")
    if ws.transport == "disk":
        return DiskWeightSync(client=client, sync_root=Path(run_dir) / "weights", template_dir=template_dir,
                              collective=collective, world_group=world_group, verify=ws.verify,
                              api_key=rollout_cfg.api_key, timeout_s=ws.timeout_s, **held)
    if ws.transport == "distributed":
        if not collective:
            raise ValueError("rollout.weight_sync.transport=distributed is called on every trainer rank (each owner "
                             "sends its own tensors): build it with collective=True")
        # CPU trainers (the embedded engine, or embedded servers behind rollout.engine=sglang on CPU
        # Slurm nodes) send over gloo; NCCL needs CUDA tensors on both ends.
        gpu = rollout_cfg.engine != "embedded" and torch.cuda.is_available()
        return DistributedWeightSync(
            backend="nccl" if gpu else "gloo",
            bucket_bytes=ws.bucket_mb << 20, timeout_s=ws.timeout_s,
            api_key=rollout_cfg.api_key, verify=ws.verify, world_group=world_group, **held)
    raise ValueError(f"rollout.weight_sync.transport must be disk or distributed, got {ws.transport!r}")
