"""Async client for SGLang's native HTTP API (sglang 0.5.23), the same against the embedded engine.

Data (``/generate``) goes through the sglang-router when ``router_url`` is set,
else through the built-in least-loaded sticky router. Control calls (pause,
abort, weight updates, cache flush) go to every healthy engine directly: the
router does not fan them out. ``continue_generation`` goes to every engine the open pause reached,
healthy or not: a pause is never left behind on an engine marked unhealthy during a weight push.

Failure policy:
- connection refused / connect timeout: the request was never accepted, so it
  is retried with exponential backoff (``max_connect_retries``), then the engine
  is marked unhealthy and, with the built-in router, the request fails over to
  another engine; with none left → ``EngineUnavailable``;
- the connection breaks after the request was sent: the engine is marked
  unhealthy and ``EngineUnavailable`` is raised (no retry: it may have run);
- no reply within ``timeout_s``: ``EngineTimeout`` after a best-effort abort;
- the engine is taken out of service (``remove_engine``: the supervisor found it dead or hung)
  while a request waits on it: the request ends at once; a turn fails over to another engine, a
  control call's broadcast skips it;
- non-2xx or malformed body: ``EngineReplyError`` (body truncated in the message).

The HTTP exchanges and their failure classes are ``rollout.transport.EngineTransport``'s; the
engines and their health are the router's (``rollout.routing``); this class holds the request path
(which engine a turn goes to, fail-over) and the control verbs.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import httpx

from sao_megatron.rollout.health import HEALTH_TIMEOUT_S, EngineState, headers_for, probe
from sao_megatron.rollout.protocol import build_generate_payload, parse_generate_reply
from sao_megatron.rollout.routing import LeastLoadedRouter
from sao_megatron.rollout.transport import EngineTransport, ExchangeHook, NeverAccepted, TakenOut
from sao_megatron.rollout.types import (
    EngineError,
    EngineTimeout,
    EngineUnavailable,
    GenerateResult,
    PauseMode,
    SamplingParams,
)

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 30.0
"""Bound on one /continue_generation: a live engine answers at once (SGLang flips a flag), so a push does
not wait the control timeout (up to minutes) on one that does not; that one is continued later."""


class RolloutClient:
    """SGLang native-API client: token-in/token-out generation plus the RL control plane."""

    def __init__(self, engine_urls: list[str], *, router_url: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0, max_connect_retries: int = 3, connect_timeout_s: float = 5.0,
                 control_timeout_s: float | None = None, retry_backoff_s: float = 0.2,
                 routed_experts_layout: tuple[int, int] | None = None,
                 on_exchange: ExchangeHook | None = None, served=None):
        """``routed_experts_layout``: (num_layers, topk) of the served model, to shape routed experts;
        ``on_exchange``: called with (path, payload, reply) after every reply (tracing, contract tests);
        ``served``: the weight version every engine must serve, owned by the weight publisher
        (``weights.readmission.CurrentWeights``: ``.version`` and, during a push, ``.pending``)."""
        self._router = LeastLoadedRouter([u.rstrip("/") for u in engine_urls])
        self.router_url = router_url.rstrip("/") if router_url else None
        self.timeout_s = timeout_s
        self.routed_experts_layout = routed_experts_layout
        self.engine_wait_s = 0.0
        """With no healthy engine, ``generate`` waits this long for one to come back (a restart) before
        raising EngineUnavailable (0: raise at once)."""
        self.served = served
        self.paused = False
        """A pause is open (between ``pause_generation`` and ``continue_generation``)."""
        self.num_pauses = 0
        """Pauses opened so far: a probe that saw one begin cannot judge the engine by /health."""
        self._paused: set[str] = set()
        """Engines sent /pause_generation and not continued since: the open pause's, and after it those whose
        continue failed (kept out of routing until continued). Health probes skip their /health, which waits."""
        # trust_env=False: a proxy from the environment must never see loopback engine traffic.
        http = httpx.AsyncClient(
            headers=headers_for(api_key), trust_env=False,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                keepalive_expiry=2.0))
        # keepalive_expiry below the servers' keep-alive timeout (uvicorn: 5 s) so a pooled
        # connection is never reused just as the server closes it (that would look like a crash).
        self._transport = EngineTransport(
            self._router, http, control_timeout_s=control_timeout_s if control_timeout_s is not None else timeout_s,
            max_connect_retries=max_connect_retries, retry_backoff_s=retry_backoff_s, on_exchange=on_exchange)

    @property
    def weight_version(self) -> int | None:
        """The version every engine must serve (the publisher's; None: not checked)."""
        return None if self.served is None else self.served.version

    def serves_current(self, reported: object) -> bool:
        """An engine reporting ``reported`` serves the published weights (or the ones being pushed)."""
        if self.served is None:
            return True
        return str(reported) in {str(self.served.version), str(getattr(self.served, "pending", None))}

    # ------------------------------------------------------------------ transport
    @property
    def engine_urls(self) -> list[str]:
        return list(self._router.urls)

    def healthy_urls(self) -> list[str]:
        return self._router.healthy()

    def engine_of(self, rid: str) -> str | None:
        """The engine the built-in router sent ``rid`` to (None if unknown or routed by sglang-router)."""
        return self._router.engine_of(rid)

    def add_engine(self, url: str) -> None:
        """A (re)started engine that serves the current weights joins data routing and control calls."""
        self._router.add(url.rstrip("/"))

    def remove_engine(self, url: str) -> None:
        """Stop sending anything to ``url`` (dead, hung or being restarted). Requests still open there
        are cut short with EngineUnavailable: control calls are skipped by the broadcast, turns fail
        over (see ``_send_tracked``). Its pause is forgotten: what answers there next is a new process."""
        self._transport.cut(url.rstrip("/"))
        self._paused.discard(url.rstrip("/"))

    def is_paused(self, url: str) -> bool:
        """This client paused ``url`` and has not continued it yet."""
        return url.rstrip("/") in self._paused

    # The transport's calls under the names the request path and control verbs below use.
    @property
    def _http(self) -> httpx.AsyncClient:
        return self._transport.http

    @_http.setter
    def _http(self, http: httpx.AsyncClient) -> None:
        self._transport.http = http

    @property
    def _open_sends(self) -> dict[str, set[asyncio.Future]]:
        return self._transport.open_sends

    def _mark_unhealthy(self, url: str, why: str) -> None:
        self._transport.mark_unhealthy(url, why)

    async def _call(self, url: str, path: str, payload: dict[str, Any] | None = None, **kw: Any) -> Any:
        return await self._transport.call(url, path, payload, **kw)

    async def _broadcast(self, path: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
        return await self._transport.broadcast(path, payload, **kw)

    async def _wait_for_engine(self) -> None:
        deadline = time.monotonic() + self.engine_wait_s
        while not self._router.healthy() and time.monotonic() < deadline:
            await asyncio.sleep(0.25)

    # ------------------------------------------------------------------ data
    async def generate(self, input_ids: list[int], sampling: SamplingParams, *, rid: str | None = None,
                       return_routed_experts: bool = False, avoid: frozenset[str] = frozenset()) -> GenerateResult:
        """Generate from ``input_ids``; the reply carries per-token log-probs and versions.

        ``avoid``: engines to use only when no other is healthy (a resubmission after a failure there)."""
        rid = rid or uuid.uuid4().hex
        payload = build_generate_payload(input_ids, sampling, rid=rid, return_routed_experts=return_routed_experts)
        if self.engine_wait_s > 0 and not self._router.healthy():
            await self._wait_for_engine()
        if self.router_url is not None:
            return await self._generate_at(self.router_url, payload, rid, return_routed_experts, via_router=True)
        tried: set[str] = set()
        deadline = time.monotonic() + self.engine_wait_s
        while True:
            try:
                url = self._router.pick(rid, frozenset(tried), avoid)
            except EngineUnavailable:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.25)  # an engine may be restarting: wait for it (engine_wait_s)
                tried.clear()
                continue
            try:
                return await self._generate_at(url, payload, rid, return_routed_experts, via_router=False)
            except NeverAccepted as exc:
                # Never accepted: marking it unhealthy and failing over cannot duplicate work.
                self._mark_unhealthy(url, str(exc))
                tried.add(url)
            except TakenOut:  # removed while waiting (its process is killed or it hangs): its reply
                tried.add(url)  # will never be used, so the turn is sent to another engine

    async def _generate_at(self, url: str, payload: dict[str, Any], rid: str, want_routed: bool,
                           via_router: bool) -> GenerateResult:
        if not via_router:
            self._router.acquire(rid, url)
        start = time.perf_counter()
        try:
            resp = await (self._transport.send("POST", url, "/generate", payload, self.timeout_s) if via_router
                          else self._transport.send_tracked("POST", url, "/generate", payload, self.timeout_s))
        except NeverAccepted as exc:
            if via_router:
                raise EngineUnavailable(f"router unreachable: {exc}", url=url) from None
            raise
        except EngineUnavailable as exc:
            if not via_router:
                self._mark_unhealthy(url, str(exc))
            raise
        except EngineTimeout:
            await self._abort_quietly(url, rid)
            raise
        finally:
            if not via_router:
                self._router.release(url)
        reply = self._transport.check(resp, url, "/generate", payload, expect_json=True)
        return parse_generate_reply(reply, rid=rid, engine_url=url, latency_s=time.perf_counter() - start,
                                    routed_experts_layout=self.routed_experts_layout,
                                    want_routed_experts=want_routed, prompt_len=len(payload["input_ids"]))

    async def _abort_quietly(self, url: str, rid: str) -> None:
        targets = self.healthy_urls() if url == self.router_url else [url]
        for target in targets:
            try:
                await self._http.post(target + "/abort_request", json={"rid": rid}, timeout=2.0)
            except httpx.HTTPError:
                pass

    # ------------------------------------------------------------------ control
    async def pause_generation(self, mode: PauseMode = "retract") -> None:
        """Pause every healthy engine: abort (partial outputs returned now), retract or in_place (kept,
        resumed later). Each engine asked counts as paused from before the call (a call whose reply was
        lost may still have paused it) until ``continue_generation`` reaches it."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
        targets = self.healthy_urls()
        self._paused.update(targets)
        self.paused = True
        self.num_pauses += 1
        await self._broadcast("/pause_generation", {"mode": mode}, urls=targets)

    async def continue_generation(self) -> None:
        """Continue every engine this client paused, those marked unhealthy since included: a pause is
        released whether the push succeeded or failed, whatever happened to the engine in between. One
        that cannot be reached stays paused in our books and out of routing; it is continued before it
        is routed again (``check_engine``) or restarted by the supervisor. EngineUnavailable when there
        were paused engines and none could be continued."""
        paused = sorted(self._paused)
        released = await self._release(paused)
        self.paused = False
        if paused and not released:
            raise EngineUnavailable(f"/continue_generation reached none of the paused engines {paused}")

    async def _release(self, urls: list[str]) -> list[str]:
        """/continue_generation to each of ``urls``, healthy or not, within RELEASE_TIMEOUT_S; those it reached."""
        timeout = min(self._transport.control_timeout_s, RELEASE_TIMEOUT_S)
        results = await asyncio.gather(*(self._call(u, "/continue_generation", {}, timeout=timeout) for u in urls),
                                       return_exceptions=True)
        released = []
        for url, res in zip(urls, results):
            if isinstance(res, EngineError):
                self._router.mark_unhealthy(url)  # routed to while paused, a request would wait for ever
                logger.warning("engine %s left paused: /continue_generation failed (%s); kept out of routing "
                               "until it is continued", url, res)
            elif isinstance(res, BaseException):
                raise res
            else:
                self._paused.discard(url)
                released.append(url)
        return released

    async def abort_request(self, rid: str) -> None:
        """Abort one request; the pending ``generate`` returns its partial output with finish_reason abort."""
        url = self._router.engine_of(rid)
        if url is not None and self._router.is_healthy(url):
            await self._call(url, "/abort_request", {"rid": rid})
        else:
            await self._broadcast("/abort_request", {"rid": rid})

    async def abort_all(self) -> None:
        await self._broadcast("/abort_request", {"abort_all": True})

    async def begin_weight_update(self) -> None:
        await self._broadcast("/begin_weight_update", {})

    async def end_weight_update(self) -> None:
        await self._broadcast("/end_weight_update", {})

    async def update_weights_from_disk(self, model_path: str, *, weight_version: int) -> None:
        """Every engine loads the HF checkpoint at ``model_path`` and reports ``weight_version``."""
        await self._broadcast("/update_weights_from_disk",
                              {"model_path": str(model_path), "weight_version": str(int(weight_version))},
                              expect_json=True)

    async def load_weights_from_disk_on(self, url: str, model_path: str, *, weight_version: int) -> None:
        """One engine (not yet routed to, e.g. restarted) loads ``model_path`` as ``weight_version``
        (no update session: SGLang's disk path post-processes the weights itself, see ``weight_sync``)."""
        await self._call(url.rstrip("/"), "/update_weights_from_disk", {"model_path": str(model_path),
                         "weight_version": str(int(weight_version))}, expect_json=True)

    async def init_weights_update_group(self, master_address: str, master_port: int, *,
                                        engine_world_sizes: list[int] | None = None,
                                        group_name: str = "weight_update_group", backend: str = "nccl") -> int:
        """Every engine joins the trainer's broadcast group (trainer = rank 0); returns the world size.

        Engine ``i`` occupies ranks ``1 + sum(engine_world_sizes[:i])`` onwards; sizes default
        to each engine's ``tp_size`` from ``/server_info``. The trainer must join the same group
        concurrently (``NcclWeightSync`` does both).
        """
        urls = self.healthy_urls()
        if engine_world_sizes is None:
            engine_world_sizes = await self.engine_world_sizes()
        if len(engine_world_sizes) != len(urls):
            raise ValueError(f"engine_world_sizes has {len(engine_world_sizes)} entries for {len(urls)} engines")
        offsets = [1 + sum(engine_world_sizes[:i]) for i in range(len(urls))]
        world_size = 1 + sum(engine_world_sizes)
        await asyncio.gather(*(self._call(u, "/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": off,
            "world_size": world_size, "group_name": group_name, "backend": backend}, expect_json=True)
            for u, off in zip(urls, offsets)))
        return world_size

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], *, group_name: str = "weight_update_group",
                                              weight_version: int | None, flush_cache: bool = True) -> None:
        """Announce one bucket; the trainer broadcasts the tensors in the same order meanwhile.

        Pass ``weight_version`` with the last bucket only (None keeps the engines' version).
        """
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        payload = {"names": list(names), "dtypes": list(dtypes), "shapes": [list(map(int, s)) for s in shapes],
                   "group_name": group_name, "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = str(int(weight_version))
        await self._broadcast("/update_weights_from_distributed", payload, expect_json=True)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await self._broadcast("/destroy_weights_update_group", {"group_name": group_name}, expect_json=True)

    async def flush_cache(self) -> None:
        """Flush every engine's prefix cache (SGLang answers 400 while requests are pending)."""
        await self._broadcast("/flush_cache", None)

    async def server_info(self) -> list[dict]:
        """``/server_info`` of every healthy engine."""
        replies = await self._broadcast("/server_info", None, method="GET", expect_json=True)
        return [dict(replies[u], url=u) for u in replies]

    async def engine_world_sizes(self) -> list[int]:
        """GPUs per healthy engine (``tp_size`` from /server_info), in ``healthy_urls()`` order."""
        by_url = {i["url"]: int(i.get("tp_size", 1)) for i in await self.server_info()}
        return [by_url[u] for u in self.healthy_urls()]

    async def model_info(self) -> list[dict]:
        """``/model_info`` of every healthy engine (includes ``weight_version``)."""
        replies = await self._broadcast("/model_info", None, method="GET", expect_json=True)
        return [dict(replies[u], url=u) for u in replies]

    async def engine_model_info(self, url: str) -> dict:
        """``/model_info`` of one engine, routed or not (e.g. restarted and not yet admitted)."""
        return await self._call(url.rstrip("/"), "/model_info", None, method="GET", expect_json=True)

    async def health(self, timeout_s: float = HEALTH_TIMEOUT_S) -> dict[str, bool]:
        """``check_engine`` on every engine, unhealthy ones included; True = alive."""
        urls = self.engine_urls
        states = await asyncio.gather(*(self.check_engine(u, timeout_s) for u in urls))
        return {u: s is not EngineState.DEAD for u, s in zip(urls, states)}

    async def check_engine(self, url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> EngineState:
        """Probe one engine (``rollout.health.probe``) and route by the answer.

        A dead engine (no answer at all) stops receiving data. A paused or stuck one keeps its status:
        SGLang's /health takes a generation step, so one slow answer is not a death (the supervisor
        restarts an engine stuck on several probes in a row). An engine comes back only once /health
        passes and it reports the last pushed weight version (one that missed an update must not serve
        stale weights); one left paused by a failed continue is continued first.
        """
        url = url.rstrip("/")
        state = await self._probe(url, timeout_s)
        if state is EngineState.OK:
            self._router.mark_healthy(url)
        elif state is EngineState.DEAD:
            self._mark_unhealthy(url, "no answer to /model_info (process gone or hung)")
        return state

    async def _probe(self, url: str, timeout_s: float) -> EngineState:
        if url in self._paused and not self.paused:  # left paused by a continue that failed
            await self._release([url])
        state = await probe(self._http, url, paused=url in self._paused, health_timeout_s=timeout_s)
        if state is not EngineState.OK or self.served is None:
            return state
        try:
            info = (await self._http.get(url + "/model_info", timeout=timeout_s)).json()
        except (httpx.HTTPError, ValueError):
            return EngineState.DEAD
        if self.serves_current(info.get("weight_version")):
            return EngineState.OK
        self._mark_unhealthy(url, f"serves weight version {info.get('weight_version')}, expected {self.weight_version}")
        return EngineState.BUSY  # alive, but kept out until it has the current weights

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


__all__ = ["RolloutClient", "EngineError"]
