"""``rollout.weight_sync.transport=disk``: safetensors parts on a shared file system, loaded by every engine.

:class:`DiskWeightSync`: every owner writes its own tensors as safetensors parts into one directory on
the shared file system (no rank-0 funnel), rank 0 adds the index and template files and renames the
directory into place atomically (``stage``: the engines keep generating), then every engine loads it
(``/update_weights_from_disk``) while generation is paused (the staged push's ``deliver``). NOT inside a
``/begin_weight_update`` session: SGLang's disk path restores, loads and post-processes the weights itself
(``model_runner_components/weight_updater.py:update_weights_from_disk`` →
``DefaultModelLoader.load_weights_and_postprocess``) and never marks the session as loaded, so
``/end_weight_update`` would run ``post_load_weights`` and ``postprocess_weights`` a second time
(``scheduler_components/weight_updater.py: end_weight_update``: ``run_post_load = not
self._session.loaded_weights``), which re-packs already processed (e.g. FP8) weights.
:func:`write_hf_safetensors` writes a whole HF directory in one process (exports, restarts).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import torch

from sao_megatron.models.families.hf_files import finish_shards, write_shards
from sao_megatron.rollout.health import headers_for
from sao_megatron.rollout.weight_check import EngineHolding, StreamingChecksums
from sao_megatron.weights.distributed import _World
from sao_megatron.weights.staged import Paused, deliver_now
from sao_megatron.weights.verify import Unverified, WeightSyncError, verify_engines

logger = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, torch.Tensor]]
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def _copy_template(template_dir: Path, out: Path) -> None:
    """Every non-weight file of an HF dir (config, generation config, tokenizer files)."""
    for src in template_dir.iterdir():
        if src.is_file() and not src.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(src, out / src.name)


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
        finish_shards(tmp, write_shards(named_tensors, tmp, max_shard_bytes=max_shard_bytes))
        if template_dir is not None:
            _copy_template(Path(template_dir), tmp)
        _atomic_replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


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
        self.http = httpx.Client(headers=headers_for(api_key), trust_env=False, timeout=timeout_s)

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
        streams = {h: StreamingChecksums(h) for h in self.holdings.values() if checksums and not h.unverifiable}

        def checksum(shard: dict[str, torch.Tensor]) -> None:
            for stream in streams.values():
                stream.update(shard.items())

        parts = write_shards(owned, tmp, max_shard_bytes=self.max_shard_bytes, stem=f"part-r{self.world.rank:05d}-",
                             on_shard=checksum)
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
        """(rank 0) Every rank's parts named and indexed as one HF checkpoint, the template files beside
        them, then the directory moves into place atomically."""
        finish_shards(tmp, parts)
        if self.template_dir is not None:
            _copy_template(Path(self.template_dir), tmp)
        _atomic_replace_dir(tmp, out)
        return out

    # ------------------------------------------------------------------ push (collective)
    def push(self, owned: NamedTensors, version: int, *, paused: Paused | None = None,
             verify: bool = False) -> dict[str, float]:
        """Write while engines keep generating, then pause → load → continue (rank 0); metrics on rank 0."""
        job = self.stage(owned, version, verify=verify)
        verdict: Any = None
        error: Exception | None = None
        if self.world.rank == 0:
            try:
                verdict = deliver_now(job, paused)
            except Exception as exc:  # shared with every rank below, then raised here
                verdict = f"{type(exc).__name__}: {exc}"
                error = exc
        verdict = self.world.bcast(verdict)
        if isinstance(verdict, str):
            if error is not None:
                raise error
            raise WeightSyncError(f"rank 0 failed the disk weight sync: {verdict}")
        self.needs_verify = self.needs_verify and not job.verify
        return verdict if self.world.rank == 0 else {}

    def stage(self, owned: NamedTensors, version: int, *, verify: bool = False) -> _Load:
        """Collective: write ``sync_root/v{version}`` now (the engines keep generating); the returned push
        loads it. The written directory is the snapshot: the next update cannot change it, and host memory
        stays at one shard whatever the model's size."""
        start = time.perf_counter()
        verify = verify or self.needs_verify
        path, sums = self.write(owned, version, checksums=verify)
        return _Load(self, path, version, sums if verify else None, written_s=time.perf_counter() - start)

    async def load(self, path: Path, version: int) -> None:
        """(rank 0) Every engine loads ``path``. No session: see the module docstring."""
        await self.client.update_weights_from_disk(str(path), weight_version=version)

    def check(self, path: Path, expected: dict | None) -> dict[str, float]:
        """(rank 0) After a load: verify the engines serving (``expected``: the written checksums, None: no
        verification), prune old directories; the load's metrics."""
        urls = self.client.healthy_urls()
        unverified = Unverified(len(urls), 0) if expected is None else verify_engines(
            self.http, [(u, self.holdings.get(u, EngineHolding(None, unverifiable="not connected"))) for u in urls],
            expected, strict=self.strict_names)
        if expected is not None:
            self.needs_verify = False
        self._prune()
        nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        return {"weight_sync/bytes": float(nbytes), **unverified.metrics()}

    def _prune(self) -> None:
        versions = sorted(p for p in self.sync_root.glob("v[0-9]*") if p.is_dir())
        for old in versions[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


class _Load:
    """A staged disk push (see ``weights.staged``): the directory is written; rank 0's engines load it."""

    reached = None

    def __init__(self, sync: DiskWeightSync, path: Path | None, version: int, expected: dict | None, *,
                 written_s: float):
        self.sync, self.path, self.version, self.expected = sync, path, version, expected
        self.verify = expected is not None
        self.written_s = written_s
        self._started: float | None = None

    async def deliver(self) -> None:
        self._started = time.perf_counter()
        await self.sync.load(self.path, self.version)

    def finish(self) -> dict[str, float]:
        """(rank 0) Verification after the pause; the write's and the load's seconds."""
        out = self.sync.check(self.path, self.expected)
        loaded = time.perf_counter() - (self._started or time.perf_counter())
        return {**out, "weight_sync/write_seconds": self.written_s, "weight_sync/load_seconds": loaded,
                "weight_sync/seconds": self.written_s + loaded}
