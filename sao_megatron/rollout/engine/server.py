"""HTTP front of the embedded engine: the subset of SGLang 0.5.23's native API an RL trainer uses.

Endpoints and reply shapes follow ``srt/entrypoints/http_server.py`` of sglang
0.5.23. ``--api-key`` is checked as SGLang does: ``Authorization: Bearer KEY``
on every endpoint except ``/health*`` (SGLang exempts health probes so routers
and orchestrators can check liveness without the secret), 401
``{"error": "Unauthorized"}`` otherwise. Anything SGLang would accept but this
engine cannot honour exactly (penalties, grammars, streaming, batches, NCCL
weight updates) is refused with a 400 naming it, never silently ignored.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sao_megatron.rollout.engine.core import EngineCore, Request as EngineRequest, request_generator, _settle
from sao_megatron.rollout.engine.sampling import RowParams

logger = logging.getLogger(__name__)

API_VERSION = "0.5.23"  # the SGLang native API this server speaks

# sampling_params keys of sglang 0.5.23 (api/v1 SamplingParams) with the only values honoured here
# (None: any value). Unknown keys are a 400, as in SGLang.
_SAMPLING_KEYS: dict[str, Any] = {
    "max_new_tokens": None, "temperature": None, "top_p": None, "top_k": None, "stop_token_ids": None,
    "ignore_eos": None, "sampling_seed": None, "no_stop_trim": None, "skip_special_tokens": None,
    "spaces_between_special_tokens": None, "stream_interval": None,
    "stop": (None, "", []), "stop_regex": (None, "", []), "min_p": (0, 0.0), "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0), "min_new_tokens": (0,), "n": (1,),
    "json_schema": (None,), "regex": (None,), "ebnf": (None,), "structural_tag": (None,), "logit_bias": (None, {}),
    "custom_params": (None,), "beam_width": (None,), "watermark": (None,), "choice": (None, []),
}


class BadRequest(ValueError):
    """A request this engine refuses (HTTP 400)."""


def _bad(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": 400}}, status_code=400)


def parse_sampling(raw: Any, runner_vocab: int) -> tuple[RowParams, int, list[int], bool, int | None]:
    """(row params, max_new_tokens, stop_token_ids, ignore_eos, sampling_seed) from ``sampling_params``."""
    raw = raw or {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be an object (batches of sampling params are not supported)")
    for key, value in raw.items():
        if key not in _SAMPLING_KEYS:
            raise BadRequest(f"unknown sampling_params field `{key}`")
        allowed = _SAMPLING_KEYS[key]
        if allowed is not None and value not in allowed:
            raise BadRequest(f"sampling_params.{key}={value!r} is not supported by the embedded engine")
    max_new = raw.get("max_new_tokens", 128)
    temperature, top_p, top_k = raw.get("temperature", 1.0), raw.get("top_p", 1.0), raw.get("top_k", -1)
    if not isinstance(max_new, int) or max_new < 0:
        raise BadRequest(f"max_new_tokens must be a non-negative integer, got {max_new!r}")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise BadRequest(f"temperature must be >= 0, got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, int) and top_k >= 1 << 30:
        top_k = -1  # SGLang's "all tokens" sentinel (TOP_K_ALL)
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k == 0 or top_k < -1:
        raise BadRequest(f"top_k must be -1 or >= 1, got {top_k!r}")
    stop_ids = raw.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and 0 <= t < runner_vocab for t in stop_ids):
        raise BadRequest(f"stop_token_ids must be token ids below the vocabulary size {runner_vocab}")
    seed = raw.get("sampling_seed")
    return (RowParams.normalised(float(temperature), float(top_p), int(top_k)), max_new, stop_ids,
            bool(raw.get("ignore_eos", False)), seed)


def create_app(core: EngineCore, *, api_key: str | None = None, host: str = "127.0.0.1", port: int = 0,
               enable_routed_experts: bool = True, served_model_name: str | None = None) -> FastAPI:
    """The FastAPI app serving ``core``."""
    app = FastAPI(title="sao-megatron embedded engine", docs_url=None, redoc_url=None, openapi_url=None)
    runner = core.runner
    state = {"port": port}

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_key and request.method != "OPTIONS" and not request.url.path.startswith("/health"):
            auth = request.headers.get("Authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token, api_key):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    async def body_of(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if not raw:
            return {}
        try:
            body = await request.json()
        except ValueError:
            raise BadRequest("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    @app.exception_handler(BadRequest)
    async def bad_request(_request: Request, exc: BadRequest):
        return _bad(str(exc))

    def make_request(body: dict[str, Any], done) -> EngineRequest:
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by the embedded engine")
        ids = body.get("input_ids")
        if ids is None:
            raise BadRequest("input_ids is required (the embedded engine is token-in/token-out)")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in ids):
            raise BadRequest("input_ids must be a non-empty list of token ids (batches are not supported)")
        if not all(0 <= t < runner.vocab_size for t in ids):
            raise BadRequest(f"input_ids contain ids outside the vocabulary [0, {runner.vocab_size})")
        if len(ids) >= runner.max_context:
            raise BadRequest(f"prompt of {len(ids)} tokens does not fit the context length {runner.max_context}")
        if body.get("logprob_start_len") not in (None, -1) or (body.get("top_logprobs_num") or 0) > 0:
            raise BadRequest("only output-token log-probs are supported (logprob_start_len=-1, top_logprobs_num=0)")
        if body.get("routed_experts_start_len") not in (None, 0):
            raise BadRequest("routed_experts_start_len must be 0")
        want_routing = bool(body.get("return_routed_experts"))
        if want_routing and not enable_routed_experts:
            raise BadRequest("routed experts were not enabled: start with --enable-return-routed-experts")
        params, max_new, stop_ids, ignore_eos, seed = parse_sampling(body.get("sampling_params"), runner.vocab_size)
        rid = body.get("rid") or uuid.uuid4().hex
        if not isinstance(rid, str):
            raise BadRequest("rid must be a string (batches are not supported)")
        stops = set(stop_ids) | (set() if ignore_eos else runner.eos_ids)
        return EngineRequest(rid=rid, prompt=list(ids), params=params, max_new_tokens=max_new, stop_ids=stops,
                             return_logprob=bool(body.get("return_logprob")), want_routing=want_routing,
                             generator=request_generator(core.seed, rid, seed), done=done)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        req = make_request(await body_of(request), lambda reply: loop.call_soon_threadsafe(_settle, fut, reply, None))

        def add() -> None:
            if any(r.rid == req.rid for r in list(core.running) + list(core.waiting)):
                raise BadRequest(f"duplicate request id {req.rid}: a request with this rid is in flight")
            core.add(req)
        await core.call(add)
        while not fut.done():
            await asyncio.wait({fut}, timeout=0.5)
            if not fut.done() and await request.is_disconnected():
                core.post(lambda: core.abort(req.rid, "client disconnected"))
                return Response(status_code=499)
        reply = fut.result()
        if "error" in reply:
            return JSONResponse({"error": {"message": reply["error"], "code": 500}}, status_code=500)
        return JSONResponse(reply)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if core.alive() else 503)

    @app.get("/health_generate")
    async def health_generate():
        if not core.alive():
            return Response(status_code=503)
        if core.paused or core.num_pending():
            return Response(status_code=200)  # busy engines are healthy, as in SGLang
        probe = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                 "rid": f"HEALTH_CHECK_{uuid.uuid4().hex}"}
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        req = make_request(probe, lambda reply: loop.call_soon_threadsafe(_settle, fut, reply, None))
        await core.call(lambda: core.add(req))
        try:
            reply = await asyncio.wait_for(fut, timeout=20)
        except TimeoutError:
            core.post(lambda: core.abort(req.rid))
            return Response(status_code=503)
        return Response(status_code=503 if "error" in reply else 200)

    @app.get("/ready")
    async def ready():
        return Response(status_code=200 if core.alive() and not core.paused else 503)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        cfg = runner.model.config
        return {"model_path": runner.model_dir, "served_model_name": served_model_name or runner.model_dir,
                "tokenizer_path": runner.model_dir, "is_generation": True, "preferred_sampling_params": None,
                "weight_version": core.weight_version, "load_format": None, "reasoning_parser": None,
                "tool_call_parser": None, "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None)}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return {"model_path": runner.model_dir, "served_model_name": served_model_name or runner.model_dir,
                "tokenizer_path": runner.model_dir, "max_context_length": runner.max_context,
                "version": f"{API_VERSION}+sao-embedded", "host": host, "port": state["port"], "tp_size": 1,
                "dp_size": 1, "max_running_requests": core.max_running, "skip_tokenizer_init": True,
                "enable_return_routed_experts": enable_routed_experts, "logprob_mode": core.logprob_mode,
                "internal_states": [{"weight_version": core.weight_version, "paused": core.paused,
                                     "num_running": len(core.running), "num_waiting": len(core.waiting),
                                     **core.stats,
                                     "num_output_tokens": {r.rid: len(r.output)
                                                           for r in list(core.running) + list(core.waiting)}}]}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if await core.call(core.num_pending):
            return Response("Flush cache failed: there are running or waiting requests.\n", status_code=400)
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        mode = (await body_of(request)).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode must be abort, retract or in_place, got {mode!r}")
        await core.call(lambda: core.pause(mode))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await body_of(request)
        await core.call(core.resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await body_of(request)
        if body.get("abort_all"):
            await core.call(core.abort_all)
        elif body.get("rid"):
            await core.call(lambda: core.abort(str(body["rid"])))
        return Response(status_code=200)

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request):
        await body_of(request)
        core.in_weight_update = True
        return {"success": True, "message": "Weight update session opened."}

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request):
        await body_of(request)
        core.in_weight_update = False
        return {"success": True, "message": "Weight update session closed."}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await body_of(request)
        path, version = body.get("model_path"), body.get("weight_version")
        if not isinstance(path, str) or (version is not None and not isinstance(version, str)):
            raise BadRequest("model_path (string) is required; weight_version must be a string")
        try:
            model = await asyncio.to_thread(runner.load_checked, path)
        except (ValueError, OSError) as exc:
            return JSONResponse({"success": False, "message": str(exc), "num_paused_requests": 0}, status_code=400)

        def swap() -> int:
            if body.get("abort_all_requests"):
                core.abort_all("aborted for a weight update")
            runner.swap(model, path)
            if version is not None:
                core.weight_version = version
            return core.num_pending()
        paused = await core.call(swap)
        logger.info("weights updated from %s, version %s", path, core.weight_version)
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": paused}

    @app.post("/init_weights_update_group")
    @app.post("/update_weights_from_distributed")
    @app.post("/destroy_weights_update_group")
    @app.post("/update_weights_from_tensor")
    async def unsupported_weight_path(request: Request):
        return JSONResponse({"success": False, "message": f"{request.url.path} needs GPUs and NCCL; the embedded "
                             f"engine loads weights from disk only (rollout.weight_sync=disk)"}, status_code=400)

    app.state.set_port = lambda p: state.__setitem__("port", p)
    return app
