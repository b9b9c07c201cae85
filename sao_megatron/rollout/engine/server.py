"""HTTP front of the embedded engine: the subset of SGLang 0.5.23's native API an RL trainer uses.

Endpoints and reply shapes follow ``srt/entrypoints/http_server.py`` of sglang
0.5.23. ``--api-key`` is checked as SGLang does: ``Authorization: Bearer KEY``
on every endpoint except ``/health*`` (SGLang exempts health probes so routers
and orchestrators can check liveness without the secret); otherwise 401
``{"error": "Unauthorized"}``. Requests this engine cannot honour exactly are
refused with a 400 (``requests.py``). Weight updates (disk, update groups over
gloo, ``/weights_checker``) are in ``weight_routes.py``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sao_megatron.rollout.engine.batching import split_generate_body
from sao_megatron.rollout.engine.core import EngineCore, settle_future
from sao_megatron.rollout.engine.request_body import json_body
from sao_megatron.rollout.engine.requests import BadRequest, ModelLimits, make_request
from sao_megatron.rollout.engine.weight_routes import WeightRoutes
from sao_megatron.rollout.engine.weights import EngineWeights

logger = logging.getLogger(__name__)

API_VERSION = "0.5.23"  # the SGLang native API this server speaks


class _ApiKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which hides client disconnects from handlers, as SGLang notes)."""

    def __init__(self, app, *, authorized):
        self.app, self.authorized = app, authorized

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not self.authorized(scope["method"], scope["path"], auth):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class EngineServer:
    """Route handlers over one ``EngineCore``; ``app()`` builds the FastAPI application."""

    def __init__(self, core: EngineCore, *, api_key: str | None = None, host: str = "127.0.0.1", port: int = 0,
                 enable_routed_experts: bool = False, served_model_name: str | None = None,
                 weight_update_timeout_s: float = 300.0, tokenizer=None):
        self.core, self.runner = core, core.runner
        self.tokenizer = tokenizer
        """An HF tokenizer (text prompts, text in replies), or None: token-in/token-out only."""
        self.weights = EngineWeights(core.runner, timeout_s=weight_update_timeout_s)
        self.weight_routes = WeightRoutes(core, self.weights)
        self.api_key = api_key
        self.host, self.port = host, port
        self.enable_routed_experts = enable_routed_experts
        self.served_model_name = served_model_name

    # ------------------------------------------------------------------ plumbing
    def limits(self) -> ModelLimits:
        r = self.runner
        return ModelLimits(r.vocab_size, r.max_context, frozenset(r.eos_ids), self.enable_routed_experts)

    def authorized(self, method: str, path: str, authorization: str) -> bool:
        if not self.api_key or method == "OPTIONS" or path.startswith("/health"):
            return True
        scheme, _, token = authorization.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token, self.api_key)

    async def submit(self, body: dict[str, Any]) -> tuple[str, asyncio.Future]:
        """Queue a request on the engine; (rid, future of its reply)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        req = make_request(body, self.limits(), seed=self.core.seed,
                           done=lambda reply: loop.call_soon_threadsafe(settle_future, fut, reply, None))

        def add() -> None:
            if any(r.rid == req.rid for r in [*self.core.running, *self.core.waiting, *self.core.held]):
                raise BadRequest(f"duplicate request id {req.rid}: a request with this rid is in flight")
            self.core.add(req)
        await self.core.call(add)
        return req.rid, fut

    # ------------------------------------------------------------------ data
    async def generate(self, request: Request):
        """One prompt, a batch (list of lists, or a list of texts) or a text (with a tokenizer loaded)."""
        bodies, batch = split_generate_body(await json_body(request), self.tokenizer)
        for body in bodies:  # refuse the whole batch before queueing any of it
            make_request(body, self.limits(), seed=self.core.seed, done=lambda _reply: None)
        submitted = [await self.submit(body) for body in bodies]
        futs = {fut for _, fut in submitted}
        while not all(f.done() for f in futs):
            await asyncio.wait(futs, timeout=0.2)
            if not all(f.done() for f in futs) and await request.is_disconnected():  # as SGLang: abort
                for rid, _ in submitted:
                    self.core.post(lambda rid=rid: self.core.abort(rid, "client disconnected"))
                return Response(status_code=499)
        replies = [fut.result() for _, fut in submitted]
        for reply in replies:
            if "error" in reply:
                return JSONResponse({"error": {"message": reply["error"], "code": 500}}, status_code=500)
            if self.tokenizer is not None:
                reply["text"] = self.tokenizer.decode(reply["output_ids"], skip_special_tokens=True)
        return JSONResponse(replies if batch else replies[0])

    async def health(self):
        return Response(status_code=200 if self.core.alive() else 503)

    async def health_generate(self):
        """A one-token probe when idle; busy or paused engines are healthy as long as the loop runs."""
        if not self.core.alive():
            return Response(status_code=503)
        if self.core.paused or self.core.num_pending():
            return Response(status_code=200)
        rid, fut = await self.submit({"input_ids": [0], "rid": f"HEALTH_CHECK_{uuid.uuid4().hex}",
                                      "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
        try:
            reply = await asyncio.wait_for(fut, timeout=20)
        except TimeoutError:
            self.core.post(lambda: self.core.abort(rid))
            return Response(status_code=503)
        return Response(status_code=503 if "error" in reply else 200)

    async def ready(self):
        return Response(status_code=200 if self.core.alive() and not self.core.paused else 503)

    # ------------------------------------------------------------------ info
    def _names(self) -> dict[str, Any]:
        path = self.runner.model_dir
        return {"model_path": path, "served_model_name": self.served_model_name or path, "tokenizer_path": path}

    async def model_info(self):
        cfg = self.runner.model.config
        return {**self._names(), "is_generation": True, "preferred_sampling_params": None,
                "weight_version": self.core.weight_version, "load_format": None, "reasoning_parser": None,
                "tool_call_parser": None, "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None)}

    async def server_info(self):
        core = self.core
        pending = [*core.running, *core.waiting, *core.held]
        return {**self._names(), "max_context_length": self.runner.max_context,
                "version": f"{API_VERSION}+sao-embedded", "host": self.host, "port": self.port, "tp_size": 1,
                "dp_size": 1, "max_running_requests": core.max_running, "skip_tokenizer_init": self.tokenizer is None,
                "enable_return_routed_experts": self.enable_routed_experts, "logprob_mode": core.logprob_mode,
                "internal_states": [{"weight_version": core.weight_version, "paused": core.paused,
                                     "num_running": len(core.running), "num_waiting": len(core.waiting),
                                     **core.stats, "num_output_tokens": {r.rid: len(r.output) for r in pending}}]}

    # ------------------------------------------------------------------ control
    async def flush_cache(self):
        if await self.core.call(self.core.num_pending):
            return Response("Flush cache failed: there are running or waiting requests.\n", status_code=400)
        return Response("Cache flushed.\n", status_code=200)

    async def pause_generation(self, request: Request):
        mode = (await json_body(request)).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode must be abort, retract or in_place, got {mode!r}")
        await self.core.call(lambda: self.core.pause(mode))
        return {"message": "Generation paused successfully.", "status": "ok"}

    async def continue_generation(self, request: Request):
        await json_body(request)
        await self.core.call(self.core.resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    async def abort_request(self, request: Request):
        body = await json_body(request)
        if body.get("abort_all"):
            await self.core.call(self.core.abort_all)
        elif body.get("rid"):
            await self.core.call(lambda: self.core.abort(str(body["rid"])))
        return Response(status_code=200)

    async def unsupported_weight_path(self, request: Request):
        return JSONResponse({"success": False, "message": f"{request.url.path} passes CUDA IPC handles; the "
                             "embedded CPU engine takes weights from disk or an update group"}, status_code=400)

    # ------------------------------------------------------------------ app
    def app(self) -> FastAPI:
        app = FastAPI(title="sao-megatron embedded engine", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_middleware(_ApiKeyMiddleware, authorized=self.authorized)
        app.add_exception_handler(BadRequest, lambda _r, exc: JSONResponse(
            {"error": {"message": str(exc), "code": 400}}, status_code=400))
        routes = [
            ("/generate", self.generate, ["POST", "PUT"]), ("/health", self.health, ["GET"]),
            ("/health_generate", self.health_generate, ["GET"]), ("/ready", self.ready, ["GET"]),
            ("/model_info", self.model_info, ["GET"]), ("/get_model_info", self.model_info, ["GET"]),
            ("/server_info", self.server_info, ["GET"]), ("/get_server_info", self.server_info, ["GET"]),
            ("/flush_cache", self.flush_cache, ["GET", "POST"]),
            ("/pause_generation", self.pause_generation, ["POST"]),
            ("/continue_generation", self.continue_generation, ["POST"]),
            ("/abort_request", self.abort_request, ["POST"]),
        ] + self.weight_routes.routes() + [("/update_weights_from_tensor", self.unsupported_weight_path, ["POST"])]
        for path, handler, methods in routes:
            app.add_api_route(path, handler, methods=methods)
        return app
