"""Scheduling core of the embedded engine: a background thread owning all request state.

The HTTP server (asyncio) never touches request state: it posts closures to
``EngineCore`` which runs them on the engine thread between model forwards, so
pause / abort / weight swaps always land between two decode steps. Each loop
iteration: run posted commands; unless paused, prefill newly admitted requests
(one forward each, which also samples their first token) and run one batched
decode step over every running request.

Pause modes (SGLang 0.5.23 semantics):
- abort: every running and waiting request finishes now with its partial output
  (finish type ``abort``); new requests are held until continue;
- retract: running requests drop their KV cache and go back to the queue with
  their output so far; after continue they are re-prefilled (prompt + output)
  under the weights live then;
- in_place: everything is frozen with its cache; after continue decoding
  resumes on the old cache (computed by the old weights, as in SGLang).
Every output token records the weight version that sampled it; replies carry
them as ``weight_versions`` spans.

Aborts (as measured against the real sglang 0.5.23 server, ``tests/sglang/``):
- ``/abort_request {"rid": R}`` aborts every request whose rid starts with R (SGLang's scheduler
  matches prefixes); an empty rid aborts nothing;
- a running request finishes with its partial output and ``{"type": "abort", "message": "Aborted"}``;
- a request in the waiting queue (not admitted yet, or retracted by a pause) is dropped with
  SGLang's short waiting-queue reply: no ``prompt_tokens``, ``routed_experts``, ``cached_tokens``
  or ``num_retractions``, and of a retracted request's output only what SGLang had already
  forwarded to its tokenizer manager: the first multiple of :data:`FORCE_STREAM_INTERVAL` tokens
  (the rest is lost);
- a request that arrives while generation is paused is held outside the queue (SGLang holds it in
  its tokenizer manager): aborts do not reach it, and it runs after ``continue``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from sao_megatron.rollout.engine.model import KVCache, ModelRunner
from sao_megatron.rollout.engine.sampling import LogprobMode, RowParams, sample_row

logger = logging.getLogger(__name__)

FORCE_STREAM_INTERVAL = 50
"""SGLang forwards a non-streaming request's output to its tokenizer manager every this many tokens
(``SGLANG_FORCE_STREAM_INTERVAL``, ``managers/scheduler_components/output_streamer.py``)."""


@dataclass(eq=False)
class Request:
    """One /generate request and everything generated for it so far."""

    rid: str
    prompt: list[int]
    params: RowParams
    max_new_tokens: int
    stop_ids: set[int]
    return_logprob: bool
    want_routing: bool
    generator: torch.Generator
    done: Callable[[dict[str, Any]], None]
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    routing: list[np.ndarray] = field(default_factory=list)
    num_retractions: int = 0
    cache: KVCache | None = None
    start: float = field(default_factory=time.perf_counter)


def request_generator(seed: int, rid: str, sampling_seed: int | None) -> torch.Generator:
    """A per-request RNG: reproducible for a (seed, rid) whatever the batching."""
    value = sampling_seed if sampling_seed is not None else int.from_bytes(
        hashlib.sha256(f"{seed}:{rid}".encode()).digest()[:8], "little")
    return torch.Generator().manual_seed(value)


def version_spans(versions: list[str]) -> list[dict[str, Any]]:
    """Run-length spans ``[{"version", "start", "end"}]`` over per-token versions."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


class EngineCore:
    """Request queue, pause state and weight version, driven by one background thread."""

    def __init__(self, runner: ModelRunner, *, weight_version: str = "0", max_running: int = 32,
                 seed: int = 0, logprob_mode: LogprobMode = "sglang"):
        self.runner = runner
        self.weight_version = weight_version
        self.max_running = max_running
        self.seed = seed
        self.logprob_mode = logprob_mode
        self.paused: str | None = None  # None or the pause mode
        self.in_weight_update = False
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: deque[Request] = deque()
        """Requests that arrived while paused: out of the scheduler's reach until continue."""
        self.error: BaseException | None = None
        self.stats = {"decode_steps": 0, "decode_rows": 0, "max_decode_batch": 0, "prefills": 0, "aborted": 0}
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine-core", daemon=True)

    # ---------------------------------------------------------------- thread plumbing
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread before the next forward."""
        self._commands.put(fn)
        self._wake.set()

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread and await its result (exceptions propagate)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                loop.call_soon_threadsafe(settle_future, fut, None, exc)
            else:
                loop.call_soon_threadsafe(settle_future, fut, result, None)
        if not self.alive():
            raise RuntimeError(f"engine thread is not running: {self.error!r}")
        self.post(run)
        return await fut

    def step(self) -> bool:
        """One scheduling iteration: posted commands, admissions (prefill), one batched decode step.

        Returns False when there was nothing to compute (idle or paused). The engine
        thread calls it in a loop; tests may drive an unstarted core with it directly.
        """
        self._run_commands()
        if self.paused or not (self.waiting or self.running):
            return False
        self._admit()
        if self.running:
            self._decode_step()
        return True

    def _loop(self) -> None:
        try:
            while not self._stop:
                if not self.step():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - the engine is dead; fail every request loudly
            logger.exception("engine thread crashed")
            self.error = exc
            for req in list(self.running) + list(self.waiting) + list(self.held):
                req.done({"error": f"engine crashed: {exc!r}", "status": 500})
        finally:
            self._run_commands()

    def _run_commands(self) -> None:
        while True:
            try:
                fn = self._commands.get_nowait()
            except queue.Empty:
                return
            fn()

    # ---------------------------------------------------------------- scheduling
    def add(self, req: Request) -> None:
        """(engine thread) Queue a request; held while paused."""
        if req.max_new_tokens == 0:
            self._finish(req, {"type": "length", "length": 0})
            return
        (self.held if self.paused else self.waiting).append(req)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting.popleft()
            self.stats["prefills"] += 1
            fwd = self.runner.prefill(req.prompt + req.output, record_routing=req.want_routing)
            req.cache = fwd.caches[0]
            if req.want_routing:
                req.routing = [fwd.routing[0]]  # a re-prefill recomputes every row under the live weights
            self.running.append(req)
            self._append_token(req, fwd.logits_bv[0])
            if not self._commands.empty():
                # A pause or weight update waits for the whole step: let it in after this prefill
                # (up to max_running prefills took 0.1-0.35 s under load); the rest are admitted next step.
                return

    def _decode_step(self) -> None:
        batch = list(self.running)
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(batch)
        self.stats["max_decode_batch"] = max(self.stats["max_decode_batch"], len(batch))
        want = any(r.want_routing for r in batch)
        fwd = self.runner.decode([r.output[-1] for r in batch], [r.cache for r in batch], record_routing=want)
        for i, req in enumerate(batch):
            req.cache = fwd.caches[i]
            if req.want_routing:
                req.routing.append(fwd.routing[i])
            self._append_token(req, fwd.logits_bv[i])

    def _append_token(self, req: Request, logits_v: torch.Tensor) -> None:
        token, logprob = sample_row(logits_v, req.params, req.generator, self.logprob_mode)
        req.output.append(token)
        req.logprobs.append(logprob)
        req.versions.append(self.weight_version)
        if token in req.stop_ids:
            self._finish(req, {"type": "stop", "matched": token})
        elif len(req.output) >= req.max_new_tokens or len(req.prompt) + len(req.output) >= self.runner.max_context:
            self._finish(req, {"type": "length", "length": len(req.output)})

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        if req in self.running:
            self.running.remove(req)
        req.cache = None
        self.stats["aborted"] += reason["type"] == "abort"
        req.done(self.reply(req, reason))

    def reply(self, req: Request, reason: dict[str, Any]) -> dict[str, Any]:
        """SGLang's /generate reply for a finished request (``text`` is the server's, with a tokenizer)."""
        meta: dict[str, Any] = {
            "id": req.rid, "finish_reason": reason, "prompt_tokens": len(req.prompt),
            "completion_tokens": len(req.output), "cached_tokens": 0, "num_retractions": req.num_retractions,
            "weight_version": self.weight_version, "weight_versions": version_spans(req.versions),
            "e2e_latency": time.perf_counter() - req.start,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(req.logprobs, req.output)]
        if req.want_routing:
            rows = np.concatenate(req.routing) if req.routing else np.zeros((0, self.runner.num_layers, max(self.runner.topk, 1)), np.int32)
            meta["routed_experts"] = base64.b64encode(np.ascontiguousarray(rows, np.int32).tobytes()).decode()
        return {"output_ids": list(req.output), "meta_info": meta}

    def waiting_abort_reply(self, req: Request) -> dict[str, Any]:
        """SGLang's reply for a request aborted in its waiting queue (``scheduler.abort_request`` pops
        it and sends an empty abort output, which the tokenizer manager merges with the output it
        already had): no prompt_tokens or routed experts; output only up to the last forwarded block."""
        n = len(req.output) // FORCE_STREAM_INTERVAL * FORCE_STREAM_INTERVAL
        spans = version_spans(req.versions[:n]) or [{"version": self.weight_version, "start": 0, "end": 0}]
        meta: dict[str, Any] = {
            "id": req.rid, "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "weight_version": self.weight_version, "e2e_latency": time.perf_counter() - req.start,
            "weight_versions": spans, "completion_tokens": n,
        }
        if req.return_logprob:
            meta.update(input_token_logprobs=[], output_token_logprobs_length=n, output_token_logprobs=[
                [lp, tok, None] for lp, tok in zip(req.logprobs[:n], req.output[:n])])
        return {"text": "", "output_ids": req.output[:n], "meta_info": meta}

    # ---------------------------------------------------------------- control (engine thread)
    def pause(self, mode: str) -> None:
        self.paused = mode
        if mode == "abort":
            self.abort_all()
        elif mode == "retract":
            for req in reversed(self.running):
                req.cache = None
                req.num_retractions += 1
                self.waiting.appendleft(req)
            self.running.clear()

    def resume(self) -> None:
        self.paused = None
        self.waiting.extend(self.held)
        self.held.clear()

    def abort(self, rid: str, message: str = "Aborted") -> None:
        """Every running or waiting request whose rid starts with ``rid`` (SGLang matches prefixes)."""
        if not rid:  # SGLang ignores an empty rid: it would match every request
            return
        self._abort([r for r in self.running if r.rid.startswith(rid)],
                    [r for r in self.waiting if r.rid.startswith(rid)], message)

    def abort_all(self, message: str = "Aborted") -> None:
        self._abort(list(self.running), list(self.waiting), message)

    def _abort(self, running: list[Request], waiting: list[Request], message: str) -> None:
        for req in waiting:
            self.waiting.remove(req)
            req.cache = None
            self.stats["aborted"] += 1
            req.done(self.waiting_abort_reply(req))
        for req in running:
            self._finish(req, {"type": "abort", "message": message, "status_code": None, "err_type": None})

    def num_pending(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.held)


def settle_future(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    """Resolve ``fut`` unless it was cancelled meanwhile (call on its loop: ``call_soon_threadsafe``)."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
