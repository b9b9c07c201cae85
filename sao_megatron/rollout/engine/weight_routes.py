"""The embedded engine's weight endpoints, answered as SGLang 0.5.23's ``http_server.py`` answers them.

Replies are ``{"success", "message"}`` with 200 on success and 400 otherwise
(``/update_weights_from_disk`` adds ``num_paused_requests``). Semantics kept
from SGLang's scheduler: one update session at a time (``/begin_weight_update``
twice, or ``/end_weight_update`` without one, fails); a distributed update
outside a session fails without touching the group; updates are serialised by
one lock (several senders into one engine take turns); a new weight version is
recorded only after a successful load, and ``flush_cache`` fails the call while
requests are running (or waiting, unless generation is paused).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from sao_megatron.rollout.engine.core import EngineCore
from sao_megatron.rollout.engine.request_body import json_body
from sao_megatron.rollout.engine.requests import BadRequest
from sao_megatron.rollout.engine.weights import EngineWeights

logger = logging.getLogger(__name__)

SESSION_REQUIRED = ("update_weights_from_distributed must run between begin_weight_update() and "
                    "end_weight_update()")
LOADED = "Succeeded to update model weights."
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")


def _field(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if key not in body:
        if default is ...:
            raise BadRequest(f"field `{key}` is required")
        return default
    value = body[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, (int, float))):
        raise BadRequest(f"field `{key}`={value!r} has the wrong type")
    return value


def _reply(success: bool, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra}, status_code=200 if success else 400)


class WeightRoutes:
    """Handlers over one engine core and its ``EngineWeights``."""

    def __init__(self, core: EngineCore, weights: EngineWeights):
        self.core, self.weights = core, weights
        self.session_open = False
        self.lock = asyncio.Lock()
        self._loads: dict[int, asyncio.Future] = {}
        """Loads of plain buckets posted to the engine thread and not awaited yet, by receive slot."""
        self._slot = 0

    async def _json(self, request: Request) -> dict[str, Any]:
        return await json_body(request)

    # ---------------------------------------------------------------- session
    async def begin_weight_update(self, request: Request):
        await self._json(request)
        async with self.lock:
            if self.session_open:
                return _reply(False, "a weight-update session is already open; call end_weight_update() first")
            self.session_open = self.core.in_weight_update = True
        return _reply(True, "Success")

    async def end_weight_update(self, request: Request):
        await self._json(request)
        async with self.lock:
            if not self.session_open:
                return _reply(False, "no weight-update session is open; call begin_weight_update() first")
            error = await self._settle(list(self._loads))
            self.session_open = self.core.in_weight_update = False
        return _reply(error is None, error or "Success")

    # ---------------------------------------------------------------- loads
    def _can_flush(self) -> bool:
        """SGLang's is_fully_idle(ignore_waiting=paused): nothing running, nothing queued unless paused."""
        return not self.core.running and (bool(self.core.paused) or not self.core.waiting)

    async def _apply(self, load: Callable[[], None], *, version: Any, flush: bool,
                     abort_all: bool) -> tuple[bool, str]:
        """Run ``load`` (into the live parameters) between two forwards, then version and flush as SGLang does."""
        def apply() -> tuple[bool, str]:
            if abort_all:
                self.core.abort_all("aborted for a weight update")
            load()
            if version is not None:
                self.core.weight_version = str(version)
            if flush and not self._can_flush():
                return False, FLUSH_REFUSED
            return True, LOADED
        return await self.core.call(apply)

    async def update_weights_from_disk(self, request: Request):
        body = await self._json(request)
        path = _field(body, "model_path", str)
        version = _field(body, "weight_version", (str, type(None)), None)
        try:  # every check from the headers, before a byte of the live weights changes
            entries = await asyncio.to_thread(self.weights.plan_checkpoint, path)
        except (ValueError, OSError) as exc:
            return _reply(False, f"Failed to update weights: {exc}", num_paused_requests=0)
        async with self.lock:  # read on the engine thread (as SGLang's scheduler does): forwards wait for it
            try:
                ok, message = await self._apply(lambda: self.weights.read_into_live(entries), version=version,
                                                flush=_field(body, "flush_cache", bool, True),
                                                abort_all=_field(body, "abort_all_requests", bool, False))
            except OSError as exc:
                return _reply(False, f"Failed to update weights: {exc}", num_paused_requests=0)
            self.core.runner.model_dir = path
        logger.info("weights updated from %s, version %s", path, self.core.weight_version)
        if ok and version is not None:  # as SGLang's tokenizer manager words it (update_weights_from_disk)
            message += f" Weight version updated to {version}."
        return _reply(ok, message, num_paused_requests=0)

    async def update_weights_from_distributed(self, request: Request):
        """Receive, then load on the engine thread. A plain bucket (no version, flush or abort) is answered
        once received and its load queued: the engine thread runs commands in order, so every later call
        (the next bucket's load, the version-carrying last one, /generate, /weights_checker) sees it
        loaded, and the next bucket is received while it loads. A failed load fails the next update call
        or /end_weight_update, as SGLang reports a failed load."""
        body = await self._json(request)
        names, dtypes = _field(body, "names", list), _field(body, "dtypes", list)
        shapes = _field(body, "shapes", list)
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest(f"names/dtypes/shapes have different lengths {len(names)}/{len(dtypes)}/{len(shapes)}")
        group = _field(body, "group_name", str, "weight_update_group")
        load_format = _field(body, "load_format", (str, type(None)), None)
        version = _field(body, "weight_version", (str, type(None)), None)
        flush, abort_all = _field(body, "flush_cache", bool, True), _field(body, "abort_all_requests", bool, False)
        if not self.session_open:
            return _reply(False, SESSION_REQUIRED)
        async with self.lock:
            slot, self._slot = self._slot, 1 - self._slot
            error = await self._settle([slot])  # its receive buffer is free once its load is done
            if error is not None:
                return _reply(False, error)
            try:
                named = await asyncio.to_thread(self.weights.receive, names, dtypes, shapes, group, load_format, slot)
                self.weights.check_loadable(named)
            except Exception as exc:  # noqa: BLE001 - SGLang answers receive failures with success=False
                logger.error("distributed update on %s failed: %s", group, exc)
                return _reply(False, f"Failed to receive weights: {exc}")
            if version is None and not flush and not abort_all:
                self._loads[slot] = asyncio.ensure_future(self.core.call(lambda: self.weights.load(named)))
                return _reply(True, LOADED)
            error = await self._settle(list(self._loads))
            if error is not None:
                return _reply(False, error)
            ok, message = await self._apply(lambda: self.weights.load(named), version=version, flush=flush,
                                            abort_all=abort_all)
        if ok and version is not None:
            message += f" Weight version updated to {version}."
        return _reply(ok, message)

    async def _settle(self, slots: list[int]) -> str | None:
        """Await the queued loads of ``slots``; SGLang's message for the first that failed, else None."""
        error = None
        for slot in slots:
            load = self._loads.pop(slot, None)
            if load is None:
                continue
            try:
                await load
            except Exception as exc:  # noqa: BLE001 - reported to the sender as SGLang reports a failed load
                logger.error("loading received weights failed: %s", exc)
                error = error or (f"Failed to update parameter online: {exc}. The full weights of the ModelRunner "
                                  "are partially updated. Please discard the whole weights.")
        return error

    # ---------------------------------------------------------------- groups
    async def init_weights_update_group(self, request: Request):
        body = await self._json(request)
        kwargs = dict(master_address=_field(body, "master_address", str), master_port=_field(body, "master_port", int),
                      rank_offset=_field(body, "rank_offset", int), world_size=_field(body, "world_size", int),
                      group_name=_field(body, "group_name", str, "weight_update_group"),
                      backend=_field(body, "backend", str, "nccl"))
        ok, message = await asyncio.to_thread(lambda: self.weights.init_group(**kwargs))
        return _reply(ok, message)

    async def destroy_weights_update_group(self, request: Request):
        body = await self._json(request)
        name = _field(body, "group_name", str, "weight_update_group")
        async with self.lock:
            ok, message = await asyncio.to_thread(self.weights.destroy_group, name)
        return _reply(ok, message)

    # ---------------------------------------------------------------- checks
    async def weights_checker(self, request: Request):
        body = await self._json(request)
        action = _field(body, "action", str, "checksum")
        skip = _field(body, "skip_tensor_list", (list, type(None)), None)
        async with self.lock:
            try:
                payload = await self.core.call(lambda: self.weights.check(action, skip))
            except ValueError as exc:
                return _reply(False, str(exc))
        if payload is None:
            return _reply(True, "Success.")
        engine_sum = hashlib.sha256(payload["per_gpu_checksum"].encode()).hexdigest()
        return _reply(True, "Success.", ranks=[payload], per_engine_checksum=engine_sum)

    def routes(self) -> list[tuple[str, Any, list[str]]]:
        return [
            ("/begin_weight_update", self.begin_weight_update, ["POST"]),
            ("/end_weight_update", self.end_weight_update, ["POST"]),
            ("/update_weights_from_disk", self.update_weights_from_disk, ["POST"]),
            ("/init_weights_update_group", self.init_weights_update_group, ["POST"]),
            ("/update_weights_from_distributed", self.update_weights_from_distributed, ["POST"]),
            ("/destroy_weights_update_group", self.destroy_weights_update_group, ["POST"]),
            ("/weights_checker", self.weights_checker, ["GET", "POST"]),
        ]
