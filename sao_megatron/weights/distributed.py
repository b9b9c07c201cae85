"""``rollout.weight_sync.transport=distributed``: every owner of a slice of the weights sends it over its own groups.

Called on EVERY trainer rank (collectively). A *sender* is a rank that owns
tensors of the export (``weights.export.iter_owned_hf_tensors``: TP shards
gathered inside their TP group, each PP stage and each EP rank with global
expert ids). Each sender joins one SGLang update group per engine
(``{prefix}_r{rank}_e{engine}``: the sender is group rank 0, the engine's ranks
``1..tp_size``), so:
- no rank-0 funnel: senders stream concurrently, each from its own link;
- fan-out: sender ``s`` visits the engines in an order rotated by ``s`` and the
  bucket index, so engines receive from different senders at the same time;
- no deadlock: a broadcast involves one sender and one engine only, and an
  engine serialises its updates (SGLang's update lock), so a wait never
  depends on a third party;
- a dead engine breaks only its own groups: the others continue, the engine is
  reported (``failed_engines``) and ``reconnect`` rebuilds its groups later.

Per push (SGLang 0.5.23 protocol): rank 0 opens ``/begin_weight_update`` on
every live engine while generation is paused (a lone process: behind its first
bucket's export); the senders stream their buckets (one ``flattened_bucket``
broadcast per bucket, one dtype per bucket so every tensor is aligned) with
``/update_weights_from_distributed`` announcing names, dtypes and shapes; the
version and ``flush_cache`` ride on a lone sender's last bucket, or, with
several senders, on a last call rank 0 makes after all of them (one small
tensor again); ``/end_weight_update``. Buckets are pipelined: the sender flattens bucket k+1
while k is on the wire, and the embedded engine receives k+1 while it loads k.
After the first push of a layout (and on demand) the engines' ``/weights_checker``
checksums are compared with the senders' own: a mismatch stops every rank with
the tensor's name. Every HTTP call and group operation is bounded by ``timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import httpx
import torch
import torch.distributed as dist

from sao_megatron.rollout.health import headers_for
from sao_megatron.rollout.update_group import FLATTENED_BUCKET, dtype_name, init_custom_process_group
from sao_megatron.rollout.weight_check import EngineHolding, StreamingChecksums, WeightMismatchError
from sao_megatron.weights.links import EngineLink, EngineSyncFailed, _SenderStats, _World, address_towards
from sao_megatron.weights.send_buffers import GLOO_PIPELINE_BYTES, Flat, SendBuffers, smallest_alone, timed
from sao_megatron.weights.staged import Paused, deliver_now
from sao_megatron.weights.verify import Unverified, WeightSyncError, verify_engines

logger = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]
__all__ = ["DistributedWeightSync", "EngineLink", "EngineSyncFailed", "WeightSyncError", "address_towards"]


class DistributedWeightSync:
    """SGLang update groups from every sender to every engine; see the module docstring."""

    def __init__(self, *, backend: str = "gloo", bucket_bytes: int = 512 << 20, timeout_s: float = 300.0,
                 api_key: str | None = None, master_address: str | None = None, group_prefix: str = "sao_wsync",
                 load_format: str | None = FLATTENED_BUCKET, verify: bool = True, device: str | None = None,
                 world_group=None, strict_names: bool = True, checkpoint_dtype: str | None = None,
                 quantized: bool = False, pipeline_bytes: int | None = None):
        """``pipeline_bytes``: buckets are cut at most this large (and at most ``bucket_bytes``) so that the
        engine loads one while the next is on the wire; None: ``GLOO_PIPELINE_BYTES`` over gloo, else
        ``bucket_bytes`` (NCCL moves a bucket faster than an HTTP round trip, so fewer calls win there).
        ``strict_names``: every exported tensor must be on the engine under its held name
        (``weight_check.held_name``; the embedded engine); False for SGLang, compared where names coincide.
        ``checkpoint_dtype``: the export's ``torch_dtype`` (what SGLang's ``--dtype auto`` resolves from);
        ``quantized``: the engines hold FP8 weights (their checksums are of dequantized weights)."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight-sync backend must be gloo or nccl, got {backend!r}")
        self.backend, self.bucket_bytes, self.timeout_s = backend, bucket_bytes, timeout_s
        self.master_address = master_address
        self.group_prefix, self.load_format, self.verify_first = group_prefix, load_format, verify
        self.strict_names, self.checkpoint_dtype, self.quantized = strict_names, checkpoint_dtype, quantized
        self.device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
        self.world = _World(world_group)
        self.http = httpx.Client(headers=headers_for(api_key), trust_env=False,
                                 timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="wsync-http")
        self.links: list[EngineLink] = []
        self.is_sender = False
        self.sender_index = 0
        self.num_senders = 0
        self.needs_verify = verify
        self.last_stats: list[_SenderStats] = []
        self._began: list[int] = []
        self.buffers = SendBuffers(self.device, flattened=load_format == FLATTENED_BUCKET)
        if pipeline_bytes is None:
            pipeline_bytes = GLOO_PIPELINE_BYTES if backend == "gloo" else bucket_bytes
        self.chunk_bytes = min(bucket_bytes, pipeline_bytes)
        self.sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wsync-send")
        self._snapshots: dict[str, torch.Tensor] = {}  # stage(snapshot=True): reused by every push

    # ------------------------------------------------------------------ HTTP
    def _post(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST and return the JSON reply; EngineSyncFailed on transport errors, timeouts or success=False."""
        try:
            resp = self.http.post(url + path, json=body)
            reply = resp.json() if resp.content else {}
        except (httpx.HTTPError, ValueError) as exc:
            raise EngineSyncFailed(f"{url}{path}: {type(exc).__name__}: {exc}") from None
        if resp.status_code != 200 or (isinstance(reply, dict) and reply.get("success") is False):
            raise EngineSyncFailed(f"{url}{path} answered HTTP {resp.status_code}: {str(reply)[:300]}")
        return reply

    # ------------------------------------------------------------------ setup (collective)
    def connect(self, engine_urls: list[str] | None, *, is_sender: bool) -> None:
        """Every rank: learn the engines (rank 0 passes ``engine_urls``) and, on senders, join their groups."""
        layout = self.world.bcast(self._engine_layout(engine_urls) if self.world.rank == 0 else None)
        if isinstance(layout, str):
            raise WeightSyncError(layout)
        senders = [r for r, s in enumerate(self.world.gather(bool(is_sender))) if s]
        self.is_sender, self.sender_index = is_sender, senders.index(self.world.rank) if is_sender else 0
        self.num_senders = len(senders)
        self.links = [EngineLink(i, url, tp, holding) for i, (url, tp, holding) in enumerate(layout)]
        if self.master_address is None:  # each sender hosts its groups' store where the engines can dial it
            self.master_address = address_towards(httpx.URL(layout[0][0]).host) if layout else "127.0.0.1"
        if is_sender:
            for link in self.links:
                self._join(link)
        self.needs_verify = self.verify_first
        self._share_failures()

    def _share_failures(self) -> None:
        """Rank 0 learns which engines any sender could not join (they stay out until ``reconnect``)."""
        bad = {u: why for part in self.world.gather({l.url: l.failed for l in self.links if l.failed})
               for u, why in part.items()}
        for link in self.links:
            link.failed = bad.get(link.url)
        if bad:
            logger.error("weight-sync groups failed for %s", bad)

    def _engine_layout(self, engine_urls: list[str] | None) -> list[tuple[str, int, EngineHolding]] | str:
        """[(url, tp_size, holding)] from /server_info, or the reason an engine cannot join SGLang's update group."""
        out = []
        for url in [u.rstrip("/") for u in engine_urls or []]:
            try:
                info = self.http.get(url + "/server_info").json()
            except (httpx.HTTPError, ValueError) as exc:
                return f"engine {url} /server_info failed: {exc}"
            dp, pp = int(info.get("dp_size", 1) or 1), int(info.get("pp_size", 1) or 1)
            if dp > 1 or pp > 1:
                return (f"engine {url} runs dp_size={dp}, pp_size={pp}: SGLang joins update groups as "
                        f"rank_offset + tp_rank and refuses distributed updates with data-parallel replicas, so "
                        f"only dp=pp=1 engines can take rollout.weight_sync.transport=distributed; use "
                        f"rollout.weight_sync.transport=disk for these engines")
            holding = EngineHolding.from_server_info(info, checkpoint_dtype=self.checkpoint_dtype,
                                                     quantized=self.quantized)
            out.append((url, int(info.get("tp_size", 1) or 1), holding))
        if not out:
            return "rollout.weight_sync.transport=distributed needs at least one engine URL"
        return out

    def _join(self, link: EngineLink) -> None:
        """Host the group with one engine (this sender = rank 0) while the engine joins it."""
        if link.group is not None:
            self._drop_group(link)
        if link.group_name:  # an engine that lived on still holds our old group: free it (best effort)
            try:
                self._post(link.url, "/destroy_weights_update_group", {"group_name": link.group_name})
            except EngineSyncFailed:
                pass
        link.joins += 1
        link.group_name = f"{self.group_prefix}_r{self.world.rank}_e{link.index}_g{link.joins}"
        with socket.socket() as s:
            s.bind((self.master_address, 0))
            port = s.getsockname()[1]
        body = {"master_address": self.master_address, "master_port": port, "rank_offset": 1,
                "world_size": 1 + link.tp_size, "group_name": link.group_name, "backend": self.backend}
        reply = self.pool.submit(self._post, link.url, "/init_weights_update_group", body)
        try:
            link.group = init_custom_process_group(
                backend=self.backend, master_address=self.master_address, master_port=port,
                world_size=1 + link.tp_size, rank=0, group_name=link.group_name,
                timeout=timedelta(seconds=self.timeout_s))
            reply.result(timeout=self.timeout_s + 10)
            link.failed = None
        except Exception as exc:  # noqa: BLE001 - this engine is out until reconnect
            link.failed = f"joining {link.group_name}: {exc}"
            link.group = None

    def _drop_group(self, link: EngineLink) -> None:
        try:
            dist.destroy_process_group(link.group)
        except Exception as exc:  # noqa: BLE001 - a broken group may not destroy cleanly
            logger.warning("destroying %s: %s", link.group_name, exc)
        link.group = None

    def reconnect(self, engine_url: str | None, new_url: str | None = None) -> None:
        """Every rank: rebuild every sender's group with a (re)started engine (rank 0 names its URL, and
        ``new_url`` if it came back elsewhere). The next push sends it the full weights and verifies them
        (a new layout for that engine); until then it keeps the weights it started with.
        """
        names = (engine_url.rstrip("/"), (new_url or engine_url).rstrip("/")) if self.world.rank == 0 else None
        names = self.world.bcast(names)
        link = next((l for l in self.links if l.url == names[0]), None)
        if link is None:
            raise WeightSyncError(f"reconnect: {names[0]} is not one of the sync's engines "
                                  f"{[l.url for l in self.links]}")
        layout = self.world.bcast(self._engine_layout([names[1]]) if self.world.rank == 0 else None)
        if isinstance(layout, str):
            raise WeightSyncError(layout)
        link.url, link.tp_size, link.holding = layout[0]
        if self.is_sender:
            self._join(link)
        else:
            link.failed = None
        self._share_failures()
        self.needs_verify = True

    def close(self) -> None:
        for link in self.links:
            if link.group is not None:
                try:
                    self._post(link.url, "/destroy_weights_update_group", {"group_name": link.group_name})
                except EngineSyncFailed as exc:
                    logger.warning("%s", exc)
                self._drop_group(link)
        self.pool.shutdown(wait=False)
        self.sender.shutdown(wait=False)
        self.http.close()

    # ------------------------------------------------------------------ push (collective)
    def push(self, owned: Iterable[tuple[str, torch.Tensor]], version: int, *, paused: Paused | None = None,
             verify: bool = False) -> dict[str, float]:
        """Every rank: send this rank's tensors; rank 0 pauses generation around it (``paused``) and returns
        the metrics (others return {}). Raises WeightSyncError / WeightMismatchError on every rank."""
        return deliver_now(self.stage(owned, version, verify=verify), paused if self.world.rank == 0 else None)

    def stage(self, owned: Iterable[tuple[str, torch.Tensor]], version: int, *, snapshot: bool = False,
              verify: bool = False) -> _Send:
        """Every rank, on the thread that trains: this rank's share of a push, to deliver later.
        ``snapshot``: copy the share into host buffers now (the next optimizer step may change the
        parameters while the delivery reads them); else the export is read, gathers included, as it is
        sent (the caller's training thread must wait for the delivery)."""
        return _Send(self, self._snapshot(owned) if snapshot else owned, version, verify)

    def _snapshot(self, owned: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """This rank's share of the export copied into host buffers reused by every push.

        Why a copy rather than holding the next optimizer step until the push read the parameters: the TP
        gathers that assemble the share are collectives over the training groups and must run on the main
        thread before it trains again, so the gathered tensors have to be kept either way. Host memory is
        the rank's owned share (all ranks together: one copy of the model); GPU memory is unchanged, since
        the push stages one bucket (rollout.weight_sync.bucket_mb) at a time onto the device."""
        pin = torch.cuda.is_available()
        out = []
        for name, tensor in owned:
            buf = self._snapshots.get(name)
            if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                buf = self._snapshots[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            buf.copy_(tensor)
            out.append((name, buf))
        return out

    def _send_all(self, owned: Iterable[tuple[str, torch.Tensor]], version: int, verify: bool) -> dict[str, float]:
        start = time.perf_counter()
        verify = verify or self.needs_verify
        stats = _SenderStats()
        opening = None
        try:  # whatever fails between begin and end, the sessions end: SGLang refuses a second begin
            live, opening = self._open_sessions(stats)
            # A lone sender's last bucket carries the version; with several, a small last call after all of
            # them does (the version must follow every sender's weights).
            carry = version if self.num_senders == 1 and self.world.rank == 0 else None
            with timed(stats.phases, "stream"):
                last = self._stream(owned, live, stats, verify, carry)
            stats.seconds = time.perf_counter() - start
            everyone: list[_SenderStats] = self.world.gather(stats)
            verdict = self._finish(last, version, everyone, verify) if self.world.rank == 0 else None
        finally:
            if opening is not None:  # sessions still opening when the export failed: end them once open
                _settle(opening)
            self._end_sessions()
        verdict = self.world.bcast(verdict)
        if isinstance(verdict, str):
            raise (WeightMismatchError if verdict.startswith("mismatch") else WeightSyncError)(verdict)
        self.needs_verify = self.needs_verify and not verify
        self.last_stats = everyone
        return {} if verdict is None else dict(verdict, **{"weight_sync/seconds": time.perf_counter() - start})

    def _open_sessions(self, stats: _SenderStats) -> tuple[Callable[[], list[int]], Future | None]:
        """Open every engine's update session; returns a function giving the live engines' indices, and the
        pending opening if any. A lone process opens them on the send thread while its first bucket is
        exported and flattened (a few ms of round trips off every push). With other ranks, every rank learns
        the live engines before its export: the export runs collectives (TP gathers) with ranks that may
        send nothing, so a broadcast placed after a rank's first bucket could wait on a rank that is
        waiting in a gather for it."""
        if self.world.size > 1:
            with timed(stats.phases, "begin"):
                live = self.world.bcast(self._begin_sessions() if self.world.rank == 0 else None)
            return (lambda: live), None
        opening = self.sender.submit(self._begin_sessions)

        def live() -> list[int]:
            with timed(stats.phases, "begin"):  # only what the opening was not hidden behind
                return opening.result()
        return live, opening

    def _begin_sessions(self) -> list[int]:
        """(rank 0) Indices of the engines whose update session opened (failed ones wait for ``reconnect``);
        every engine is asked at once."""
        links = [link for link in self.links if link.failed is None]
        replies = [self.pool.submit(self._post, link.url, "/begin_weight_update", {}) for link in links]
        live = []
        for link, reply in zip(links, replies):
            try:
                reply.result()
                live.append(link.index)
            except EngineSyncFailed as exc:
                link.failed = str(exc)
                logger.error("engine %s left out of this sync: %s", link.url, exc)
        self._began = live
        return live

    def _stream(self, owned, live: Callable[[], list[int]], stats: _SenderStats, verify: bool,
                carry: int | None) -> Flat | None:
        """Send every bucket. ``carry``: the version, which rides on the last bucket (a lone sender);
        None: rank 0 returns the version-carrying last call's bucket, its smallest tensor outside any loader
        group sent once more (it must carry a tensor, and a small one makes the call cost a round trip and
        the engines' last loads, not a whole bucket's receive and load in series).

        Pipelined: bucket k+1 is flattened into the other send buffer while bucket k is on the wire
        (``_send_to_engines`` in the send thread), so a push costs the broadcasts plus one flatten. The next
        bucket is taken from the export before bucket k is sent, to know whether k is the last."""
        final: tuple[str, torch.Tensor] | None = None
        inflight = None
        engines: list[int] | None = None
        streams: dict[EngineHolding, StreamingChecksums] = {}  # fused parameters hashed across buckets
        buckets = _buckets(owned, self.chunk_bytes)
        try:
            k, bucket = 0, next(buckets, None)
            while bucket is not None:
                following = next(buckets, None)
                stats.owned += sum(t.numel() * t.element_size() for _, t in bucket)
                if verify:
                    for holding in {l.holding for l in self.links if not l.holding.unverifiable}:
                        streams.setdefault(holding, StreamingChecksums(holding)).update(bucket)
                if self.world.rank == 0 and carry is None:
                    final = smallest_alone(bucket, final)
                flat = self._flatten(bucket, k, stats)  # overlaps the send of bucket k-1
                if engines is None:
                    engines = live()
                if inflight is not None:
                    self._wait_send(inflight, stats)
                inflight = self.sender.submit(self._send_to_engines, flat, engines, k, stats,
                                              version=carry if following is None else None)
                k, bucket = k + 1, following
        finally:  # an export that fails mid-push: the bucket on the wire completes before the sessions end
            if inflight is not None:
                self._wait_send(inflight, stats)
        if engines is None:
            live()
        stats.checksums = {holding: stream.result() for holding, stream in streams.items()}
        return None if final is None else self._flatten([final], 0, stats)

    def _wait_send(self, inflight, stats: _SenderStats) -> None:
        start = time.perf_counter()
        inflight.result()
        stats.phases["wait_send"] = stats.phases.get("wait_send", 0.0) + time.perf_counter() - start

    def _send_to_engines(self, flat: Flat, live: list[int], k: int, stats: _SenderStats, *,
                         version: int | None) -> None:
        order = [self.links[live[(self.sender_index + k + j) % len(live)]] for j in range(len(live))] if live else []
        for link in order:
            if link.failed or link.url in stats.failed:
                continue
            try:
                self._send_bucket(link, flat, version)
                stats.bytes += flat.nbytes
                stats.buckets += 1
            except EngineSyncFailed as exc:
                stats.failed[link.url] = str(exc)
                logger.error("weight sync to %s failed: %s", link.url, exc)

    def _send_bucket(self, link: EngineLink, flat: Flat, version: int | None) -> None:
        """Announce and broadcast one bucket to one engine; EngineSyncFailed if either side fails."""
        if link.group is None:
            raise EngineSyncFailed(f"{link.url}: no update group (call reconnect)")
        bucket = flat.bucket
        body = {"names": [n for n, _ in bucket], "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": link.group_name,
                "flush_cache": version is not None, "abort_all_requests": False, "load_format": self.load_format}
        if version is not None:
            body["weight_version"] = str(int(version))
        # The broadcast waits on gloo's (NCCL's) own thread for the engine to join, which it does once it
        # has the announcement: so this thread makes the call itself, no hop to another one.
        if flat.buf is not None:
            works = [dist.broadcast(flat.buf, src=0, group=link.group, async_op=True)]
        else:
            works = [dist.broadcast(t.detach().to(self.device).contiguous(), src=0, group=link.group, async_op=True)
                     for _, t in bucket]
        try:
            self._post(link.url, "/update_weights_from_distributed", body)  # answered after the receive
            for work in works:
                work.wait(timedelta(seconds=self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - the pending broadcast is abandoned with the group
            link.group = None  # half-done collectives poison the group: rebuilt by reconnect
            self.buffers.drop(flat)  # the abandoned send may still read it
            raise EngineSyncFailed(str(exc)) from None

    def _flatten(self, bucket: NamedTensors, k: int, stats: _SenderStats) -> Flat:
        with timed(stats.phases, "flatten"):
            return self.buffers.flatten(bucket, k)

    def _finish(self, last: Flat | None, version: int, everyone: list[_SenderStats],
                verify: bool) -> dict[str, float] | str:
        """(rank 0) The version-carrying last bucket, session ends, checksums; metrics or an error message."""
        failed = {u: why for s in everyone for u, why in s.failed.items()}
        for link in self.links:
            if link.failed is None and link.url in failed:
                link.failed = failed[link.url]
        if not everyone[0].owned:  # an error verdict, not a raise: every rank must reach the broadcast
            return f"weight sync of version {version}: rank 0 exported no tensors (it owns the embedding)"
        stats0 = _SenderStats()
        if last is not None:  # several senders: the version follows all of them
            live = [l.index for l in self.links if l.failed is None]
            with timed(everyone[0].phases, "last_bucket"):
                self._send_to_engines(last, live, 0, stats0, version=version)
        for link in self.links:
            if link.url in stats0.failed and link.failed is None:
                link.failed = stats0.failed[link.url]
        with timed(everyone[0].phases, "end"):
            self._end_sessions()
        ok = [l for l in self.links if l.failed is None]
        if not ok:
            return f"weight sync of version {version} reached no engine: " + "; ".join(
                f"{l.url}: {l.failed}" for l in self.links)
        unverified = Unverified(len(ok), 0)
        if verify:
            expected: dict[EngineHolding, dict[str, str]] = {}
            for s in everyone:
                for holding, sums in s.checksums.items():
                    expected.setdefault(holding, {}).update(sums)
            try:
                with timed(everyone[0].phases, "verify"):
                    unverified = self._verify(ok, expected)
            except WeightMismatchError as exc:
                return f"mismatch: {exc}"
        return self._metrics(everyone, stats0, unverified)

    def _end_sessions(self) -> None:
        """(rank 0) End every session this push opened (failed engines too: a live one must not keep a
        session open); once only, every engine at once."""
        began, self._began = self._began, []
        links = [l for l in self.links if l.index in began]
        for link, reply in [(l, self.pool.submit(self._post, l.url, "/end_weight_update", {})) for l in links]:
            try:
                reply.result()
            except EngineSyncFailed as exc:
                link.failed = link.failed or str(exc)

    def _verify(self, links: list[EngineLink], expected: dict[EngineHolding, dict[str, str]]) -> Unverified:
        return verify_engines(self.http, [(l.url, l.holding) for l in links], expected, strict=self.strict_names)

    def _metrics(self, everyone: list[_SenderStats], stats0: _SenderStats,
                 unverified: Unverified) -> dict[str, float]:
        """``weight_sync/verified`` is 1 only when every engine the push reached had its checksums compared."""
        failed = [l for l in self.links if l.failed is not None]
        # the version-carrying call repeats one tensor already delivered: not counted as weights sent
        return {"weight_sync/bytes": float(sum(s.bytes for s in everyone)),
                "weight_sync/engine_bytes": float(sum(s.owned for s in everyone)),
                "weight_sync/num_senders": float(sum(s.owned > 0 for s in everyone)),
                "weight_sync/sender_bytes_max": float(max(s.owned for s in everyone)),
                "weight_sync/sender_seconds_max": max((s.seconds for s in everyone), default=0.0),
                "weight_sync/buckets": float(sum(s.buckets for s in everyone) + stats0.buckets),
                **{f"weight_sync/{k}_seconds": v for k, v in everyone[0].phases.items()},
                "weight_sync/failed_engines": float(len(failed)), **unverified.metrics()}

    def failed_engines(self) -> dict[str, str]:
        """(rank 0) URL → reason for engines left out of the last push (they serve the previous version)."""
        return {l.url: l.failed for l in self.links if l.failed is not None}


class _Send:
    """A staged distributed push (see ``weights.staged``): every rank sends its share on delivery."""

    path = None

    def __init__(self, sync: DistributedWeightSync, owned: Iterable[tuple[str, torch.Tensor]], version: int,
                 verify: bool):
        self.sync, self.owned, self.version, self.verify = sync, owned, version, verify
        self.reached: set[str] | None = None
        self._metrics: dict[str, float] = {}

    async def deliver(self) -> None:
        """Stream the buckets on a thread of its own (rank 0: the event loop keeps serving the pause)."""
        self._metrics = await asyncio.to_thread(self.sync._send_all, self.owned, self.version, self.verify)

    def finish(self) -> dict[str, float]:
        self.reached = {l.url for l in self.sync.links if l.failed is None}
        return self._metrics if self.sync.world.rank == 0 else {}


def _settle(future: Future) -> None:
    """Wait for ``future`` without raising (its failure is reported where its result is used)."""
    try:
        future.result()
    except Exception:  # noqa: BLE001
        pass


def _buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[NamedTensors]:
    """Buckets of at most ``bucket_bytes`` (a larger unit alone), one dtype each except that the tensors
    SGLang's loader must see in one call travel together (``rollout/loader_groups.py``)."""
    from sao_megatron.rollout.loader_groups import iter_buckets

    units = ((n, t.numel() * t.element_size(), t.dtype, (n, t.detach())) for n, t in named)
    yield from iter_buckets(units, family=None, max_bucket_bytes=bucket_bytes)
