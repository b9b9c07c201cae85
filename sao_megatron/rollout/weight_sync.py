"""Push trainer weights (HF names, full tensors) to the rollout engines: one interface, two transports.

``build_weight_sync(rollout_cfg, ...)`` is the one place that picks the
transport from ``rollout.weight_sync``:
- ``disk`` (:class:`DiskWeightSync`): every owner writes its own tensors as
  safetensors parts into one directory on the shared file system (no rank-0
  funnel), rank 0 adds the index and template files and renames the directory
  into place atomically, then every engine loads it (``/update_weights_from_disk``)
  while generation is paused. NOT inside a ``/begin_weight_update`` session: SGLang's
  disk path restores, loads and post-processes the weights itself
  (``model_runner_components/weight_updater.py:update_weights_from_disk`` →
  ``DefaultModelLoader.load_weights_and_postprocess``) and never marks the session as
  loaded, so ``/end_weight_update`` would run ``post_load_weights`` and
  ``postprocess_weights`` a second time (``scheduler_components/weight_updater.py:
  end_weight_update``: ``run_post_load = not self._session.loaded_weights``), which
  re-packs already processed (e.g. FP8) weights;
- ``distributed`` (``nccl`` accepted as an alias): SGLang's update groups, see
  ``weight_sync_distributed.py``.

Both are called the same way on every trainer rank (``collective=True``) with
this rank's share of the export (``training.run.export.iter_owned_hf_tensors``):
``connect(engine_urls, is_sender=...)`` once, ``push(owned, version, paused=...)``
per step, ``reconnect(url)`` for a restarted engine, ``close()``. With
``collective=False`` a disk sync runs in rank 0 alone (a rank-0 stream).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch

from sao_megatron.config.schema import RolloutConfig
from sao_megatron.rollout.weight_check import EngineHolding, StreamingChecksums
from sao_megatron.rollout.weight_sync_distributed import (
    DistributedWeightSync, Paused, Unverified, WeightSyncError, _World, verify_engines)

logger = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, torch.Tensor]]
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


class WeightSync(Protocol):
    """What the trainer calls on every rank (see the module docstring)."""

    def connect(self, engine_urls: list[str] | None, *, is_sender: bool) -> None: ...

    def push(self, owned: NamedTensors, version: int, *, paused: Paused | None = None,
             verify: bool = False) -> dict[str, float]: ...

    def reconnect(self, engine_url: str | None, new_url: str | None = None) -> None: ...

    def close(self) -> None: ...


def _copy_template(template_dir: Path, out: Path) -> None:
    """Every non-weight file of an HF dir (config, generation config, tokenizer files)."""
    for src in template_dir.iterdir():
        if src.is_file() and not src.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(src, out / src.name)


def _save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def _shards(named_tensors: NamedTensors, max_shard_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Group tensors (CPU, contiguous, unaliased) into shards of at most ``max_shard_bytes``."""
    shard: dict[str, torch.Tensor] = {}
    size = 0
    seen: set[str] = set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name} given twice")
        seen.add(name)
        t = tensor.detach().to("cpu").contiguous()
        if t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # a view into a larger storage: safetensors refuses tensors sharing storage
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            yield shard
            shard, size = {}, 0
        shard[name] = t
        size += nbytes
    if shard:
        yield shard


def write_hf_safetensors(named_tensors: NamedTensors, out_dir: str | Path, *, template_dir: str | Path | None = None,
                         max_shard_bytes: int = 4 << 30) -> Path:
    """Write an HF checkpoint directory atomically; returns ``out_dir``.

    Shards are ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``
    (a single shard is ``model.safetensors``). Everything is written in a temporary
    sibling directory then renamed, so readers never see a half-written checkpoint;
    an existing ``out_dir`` is replaced.
    """
    out_dir = Path(out_dir)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        files, weight_map, total = [], {}, 0
        for i, shard in enumerate(_shards(named_tensors, max_shard_bytes)):
            name = f"shard-{i:05d}.safetensors"
            _save_shard(shard, tmp / name)
            files.append(name)
            for key, t in shard.items():
                weight_map[key] = name
                total += t.numel() * t.element_size()
        if not files:
            raise ValueError("no tensors to write")
        final = _final_names(len(files))
        for old, new in zip(files, final):
            os.replace(tmp / old, tmp / new)
        if len(final) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {k: final[files.index(v)] for k, v in sorted(weight_map.items())}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if template_dir is not None:
            _copy_template(Path(template_dir), tmp)
        _atomic_replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _final_names(n: int) -> list[str]:
    if n == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _atomic_replace_dir(src: Path, dst: Path) -> None:
    if not dst.exists():
        os.replace(src, dst)
        return
    trash = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(dst, trash)
    os.replace(src, dst)
    shutil.rmtree(trash, ignore_errors=True)




class DiskWeightSync:
    """safetensors parts on a shared file system + ``/update_weights_from_disk`` on every engine."""

    def __init__(self, *, client, sync_root: str | Path, template_dir: str | Path | None, keep_last: int = 2,
                 max_shard_bytes: int = 4 << 30, collective: bool = True, world_group=None, verify: bool = True,
                 api_key: str | None = None, timeout_s: float = 300.0, strict_names: bool = True,
                 checkpoint_dtype: str | None = None, quantized: bool = False):
        """``client``: rank 0's RolloutClient (None elsewhere); it must live on the loop ``paused`` runs on.
        ``strict_names``, ``checkpoint_dtype``, ``quantized``: see ``DistributedWeightSync``."""
        self.client = client
        self.sync_root, self.template_dir = Path(sync_root), template_dir
        self.keep_last, self.max_shard_bytes = max(1, keep_last), max_shard_bytes
        self.world = _World(world_group) if collective else _World.alone()
        self.needs_verify = self.verify_first = verify
        self.strict_names, self.checkpoint_dtype, self.quantized = strict_names, checkpoint_dtype, quantized
        self.holdings: dict[str, EngineHolding] = {}
        """Engine URL → how it holds the weights (for checksums), learned at connect/reconnect."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, trust_env=False, timeout=timeout_s)

    def connect(self, engine_urls: list[str] | None, *, is_sender: bool) -> None:
        """Nothing to join (engines read the shared file system): learn how each engine holds weights."""
        self.holdings = self.world.bcast(self._holdings(engine_urls) if self.world.rank == 0 else None)
        self.needs_verify = self.verify_first

    def reconnect(self, engine_url: str | None, new_url: str | None = None) -> None:
        """A restarted engine loads the next pushed directory (the client must route to it); verify that push."""
        urls = [new_url or engine_url] if self.world.rank == 0 and (new_url or engine_url) else []
        self.holdings |= self.world.bcast(self._holdings(urls) if self.world.rank == 0 else None)
        self.needs_verify = True

    def _holdings(self, urls: list[str] | None) -> dict[str, EngineHolding]:
        out = {}
        for url in [u.rstrip("/") for u in urls or []]:
            try:
                info = self.http.get(url + "/server_info").json()
            except (httpx.HTTPError, ValueError) as exc:
                info = {}
                logger.warning("%s/server_info failed (%s): its weights are not verified", url, exc)
            out[url] = (EngineHolding.from_server_info(info, checkpoint_dtype=self.checkpoint_dtype,
                                                       quantized=self.quantized)
                        if info else EngineHolding(None, unverifiable="no /server_info"))
        return out

    def close(self) -> None:
        self.http.close()

    # ------------------------------------------------------------------ write (collective)
    def write(self, owned: NamedTensors, version: int, *, checksums: bool = False) -> tuple[Path | None, dict]:
        """Every rank writes its parts; rank 0 completes ``sync_root/v{version}`` and returns it
        (with the gathered checksums when asked); other ranks get (None, {})."""
        token = self.world.bcast(uuid.uuid4().hex[:8])
        tmp = self.sync_root / f".v{version:06d}.tmp-{token}"
        tmp.mkdir(parents=True, exist_ok=True)
        parts = []
        streams = {h: StreamingChecksums(h) for h in self.holdings.values() if checksums and not h.unverifiable}
        for i, shard in enumerate(_shards(owned, self.max_shard_bytes)):
            name = f"part-r{self.world.rank:05d}-{i:05d}.safetensors"
            _save_shard(shard, tmp / name)
            parts.append((name, {k: t.numel() * t.element_size() for k, t in shard.items()}))
            for stream in streams.values():
                stream.update(shard.items())
        everyone = self.world.gather((parts, {h: stream.result() for h, stream in streams.items()}))
        if self.world.rank != 0:
            return None, {}
        try:
            out = self._finalize(tmp, [p for part, _ in everyone for p in part], self.sync_root / f"v{version:06d}")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        merged: dict[EngineHolding, dict[str, str]] = {}
        for _, s in everyone:
            for holding, part in s.items():
                merged.setdefault(holding, {}).update(part)
        return out, merged

    def _finalize(self, tmp: Path, parts: list[tuple[str, dict[str, int]]], out: Path) -> Path:
        """(rank 0) Index + template files, then the directory moves into place atomically."""
        if not parts:
            raise ValueError("no tensors to write")
        names = [n for _, sizes in parts for n in sizes]
        if len(names) != len(set(names)):
            raise ValueError(f"tensors written twice: {sorted({n for n in names if names.count(n) > 1})[:5]}")
        if len(parts) == 1:
            os.replace(tmp / parts[0][0], tmp / "model.safetensors")
        else:
            weight_map = {n: f for f, sizes in parts for n in sizes}
            index = {"metadata": {"total_size": sum(sum(s.values()) for _, s in parts)},
                     "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if self.template_dir is not None:
            _copy_template(Path(self.template_dir), tmp)
        _atomic_replace_dir(tmp, out)
        return out

    # ------------------------------------------------------------------ push (collective)
    def push(self, owned: NamedTensors, version: int, *, paused: Paused | None = None,
             verify: bool = False) -> dict[str, float]:
        """Write while engines keep generating, then pause → load → continue (rank 0); metrics on rank 0."""
        start = time.perf_counter()
        verify = verify or self.needs_verify
        path, sums = self.write(owned, version, checksums=verify)
        written = time.perf_counter()
        verdict: Any = None
        error: Exception | None = None
        if self.world.rank == 0:
            try:
                verdict = self._load(path, version, paused, sums if verify else None)
            except Exception as exc:  # shared with every rank below, then raised here
                verdict = f"{type(exc).__name__}: {exc}"
                error = exc
        verdict = self.world.bcast(verdict)
        if isinstance(verdict, str):
            if error is not None:
                raise error
            raise WeightSyncError(f"rank 0 failed the disk weight sync: {verdict}")
        self.needs_verify = self.needs_verify and not verify
        if self.world.rank != 0:
            return {}
        return {**verdict, "weight_sync/write_seconds": written - start,
                "weight_sync/load_seconds": time.perf_counter() - written,
                "weight_sync/seconds": time.perf_counter() - start}

    def load_written(self, path: Path, version: int, sums: dict, *, verify: bool,
                     paused: Paused | None = None) -> dict[str, float]:
        """(rank 0, ``collective=False``) The second half of ``push`` for a directory ``write`` returned: for a
        caller that writes on its main thread and loads on another (``training.run.publisher``)."""
        start = time.perf_counter()
        verdict = self._load(path, version, paused, sums if verify else None)
        self.needs_verify = self.needs_verify and not verify
        return {**verdict, "weight_sync/load_seconds": time.perf_counter() - start}

    def _load(self, path: Path, version: int, paused: Paused | None, expected: dict | None) -> dict:
        async def update() -> None:  # no session: see the module docstring
            await self.client.update_weights_from_disk(str(path), weight_version=version)
        if paused is None:
            asyncio.run(update())
        else:
            paused(update)
        urls = self.client.healthy_urls()
        unverified = Unverified(len(urls), 0) if expected is None else verify_engines(
            self.http, [(u, self.holdings.get(u, EngineHolding(None, unverifiable="not connected"))) for u in urls],
            expected, strict=self.strict_names)
        self._prune()
        nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        return {"weight_sync/bytes": float(nbytes), **unverified.metrics()}

    def _prune(self) -> None:
        versions = sorted(p for p in self.sync_root.glob("v[0-9]*") if p.is_dir())
        for old in versions[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def build_weight_sync(rollout_cfg, *, client, run_dir: str | Path, template_dir: str | Path | None,
                      collective: bool = True, world_group=None, checkpoint_dtype: str | None = None) -> WeightSync:
    """The transport ``rollout_cfg.weight_sync`` names (``nccl`` is an alias of ``distributed``).

    ``client``: rank 0's RolloutClient (None on the other ranks). ``collective``: every trainer
    rank calls the sync (required by ``distributed``); False runs a disk sync on rank 0 alone.
    ``checkpoint_dtype``: the export's ``torch_dtype`` (how SGLang's ``--dtype auto`` holds it).
    """
    sync = _build_transport(rollout_cfg, client=client, run_dir=run_dir, template_dir=template_dir,
                            collective=collective, world_group=world_group, checkpoint_dtype=checkpoint_dtype)
    return Fp8BlockSync(sync) if rollout_cfg.engine_weight_format == "fp8_block" else sync


class Fp8BlockSync:
    """A transport whose pushes send block-FP8 weights (``fp8_weights.requantize``) for FP8-serving engines,
    quantized as the engines' own ``quantization_config`` says (read at ``connect``)."""

    def __init__(self, inner: WeightSync, scheme=None):
        self.inner, self.scheme = inner, scheme

    def connect(self, engine_urls: list[str] | None, *, is_sender: bool) -> None:
        from sao_megatron.rollout.fp8_weights import engine_scheme

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
        from sao_megatron.rollout.fp8_weights import requantize

        if self.scheme is None:
            raise WeightSyncError("Fp8BlockSync.push before connect: the engines' quantization_config is not known")
        return self.inner.push(requantize(owned, self.scheme), version, paused=paused, verify=verify)

    def reconnect(self, engine_url: str | None, new_url: str | None = None) -> None:
        self.inner.reconnect(engine_url, new_url)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str):  # transport-specific extras (failed_engines, ...)
        return getattr(self.inner, name)


def _build_transport(rollout_cfg: RolloutConfig, *, client, run_dir, template_dir, collective, world_group,
                     checkpoint_dtype) -> WeightSync:
    kind = "distributed" if rollout_cfg.weight_sync == "nccl" else rollout_cfg.weight_sync
    strict = rollout_cfg.engine == "embedded"  # it names every tensor as weight_check.held_name does
    held = dict(strict_names=strict, checkpoint_dtype=checkpoint_dtype,
                quantized=rollout_cfg.engine_weight_format == "fp8_block")
    if kind == "disk":
        return DiskWeightSync(client=client, sync_root=Path(run_dir) / "weights", template_dir=template_dir,
                              collective=collective, world_group=world_group, verify=rollout_cfg.weight_sync_verify,
                              api_key=rollout_cfg.api_key, timeout_s=rollout_cfg.weight_sync_timeout_s, **held)
    if kind == "distributed":
        if not collective:
            raise ValueError("rollout.weight_sync=distributed is called on every trainer rank (each owner sends "
                             "its own tensors): build it with collective=True")
        # CPU trainers (the embedded engine, or embedded servers behind rollout.engine=sglang on CPU
        # Slurm nodes) send over gloo; NCCL needs CUDA tensors on both ends.
        gpu = rollout_cfg.engine != "embedded" and torch.cuda.is_available()
        return DistributedWeightSync(
            backend="nccl" if gpu else "gloo",
            bucket_bytes=rollout_cfg.weight_sync_bucket_mb << 20, timeout_s=rollout_cfg.weight_sync_timeout_s,
            api_key=rollout_cfg.api_key, verify=rollout_cfg.weight_sync_verify, world_group=world_group, **held)
    raise ValueError(f"rollout.weight_sync must be disk or distributed (nccl is an alias), got {kind!r}")
