"""HTTP to the engines for ``RolloutClient``: connect retries, failure classes, per-engine cut-off, fan-out.

The failure policy is the client's (see ``rollout.client``): a request never accepted
(``NeverAccepted``) may be sent elsewhere; a connection lost after sending raises
``EngineUnavailable``; no reply in time raises ``EngineTimeout``; an engine taken out of service
(``cut``) ends the requests waiting on it at once (``TakenOut``). Which engines exist and which
are healthy is the router's (``rollout.routing.LeastLoadedRouter``), shared with the client.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import httpx

from sao_megatron.rollout.protocol import truncate
from sao_megatron.rollout.routing import LeastLoadedRouter
from sao_megatron.rollout.types import EngineReplyError, EngineTimeout, EngineUnavailable

logger = logging.getLogger(__name__)

# (path, request payload or None, parsed JSON reply or None) after every exchange that got a reply.
ExchangeHook = Callable[[str, "dict[str, Any] | None", Any], None]


class NeverAccepted(Exception):
    """Connection refused or connect timeout after all retries: safe to send elsewhere."""


class TakenOut(EngineUnavailable):
    """The engine was removed (dead or hung) while the request waited: it will not answer, so a turn
    is sent elsewhere; a control call skips it."""


class EngineTransport:
    """One HTTP connection pool to the engines and the rules for what a failed exchange means."""

    def __init__(self, router: LeastLoadedRouter, http: httpx.AsyncClient, *, control_timeout_s: float,
                 max_connect_retries: int, retry_backoff_s: float, on_exchange: ExchangeHook | None) -> None:
        self.router, self.http = router, http
        self.control_timeout_s = control_timeout_s
        self.max_connect_retries = max_connect_retries
        self.retry_backoff_s = retry_backoff_s
        self.on_exchange = on_exchange
        self.open_sends: dict[str, set[asyncio.Future]] = {}
        self._cut: set[asyncio.Future] = set()
        """Open requests cancelled by ``cut`` (told apart from the caller's own cancellation)."""

    def cut(self, url: str) -> None:
        """Stop sending anything to ``url``; requests still open there end with ``TakenOut``."""
        self.router.remove(url)
        for task in self.open_sends.pop(url, set()):
            self._cut.add(task)
            task.cancel()

    def mark_unhealthy(self, url: str, why: str) -> None:
        if url in self.router.inflight and self.router.is_healthy(url):
            logger.warning("engine %s marked unhealthy: %s", url, why)
            self.router.mark_unhealthy(url)

    async def send_tracked(self, method: str, url: str, path: str, payload: dict[str, Any] | None,
                            timeout: float) -> httpx.Response:
        """``send`` to one engine, cut short by ``cut`` (``RolloutClient.remove_engine``). Written by hand
        because httpx has no per-host cancellation: once the supervisor has judged an engine hung (~21 s),
        a weight push or a turn waiting on it must not hold on for the rest of its timeout (120 s to 10 min)."""
        task = asyncio.ensure_future(self.send(method, url, path, payload, timeout))
        self.open_sends.setdefault(url, set()).add(task)
        try:
            return await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task in self._cut and (me is None or not me.cancelling()):
                raise TakenOut(f"{url}{path}: the engine was taken out of service (dead or hung) "
                                "while this request waited", url=url) from None
            raise
        finally:
            self._cut.discard(task)
            open_sends = self.open_sends.get(url)
            if open_sends is not None:
                open_sends.discard(task)

    async def send(self, method: str, url: str, path: str, payload: dict[str, Any] | None,
                    timeout: float) -> httpx.Response:
        """One HTTP exchange with connect-only retries; raises NeverAccepted, EngineUnavailable, EngineTimeout."""
        for attempt in range(self.max_connect_retries + 1):
            try:
                return await self.http.request(method, url + path, json=payload, timeout=timeout)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if attempt == self.max_connect_retries:
                    raise NeverAccepted(f"{url}{path}: cannot connect after {attempt + 1} attempts: "
                                         f"{exc!r}") from exc
                await asyncio.sleep(self.retry_backoff_s * 2 ** attempt)
            except httpx.TimeoutException as exc:
                raise EngineTimeout(f"{url}{path}: no reply within {timeout} s", url=url) from exc
            except httpx.TransportError as exc:
                raise EngineUnavailable(f"{url}{path}: connection lost mid-request: {exc!r}", url=url) from exc
        raise AssertionError("unreachable")

    def check(self, resp: httpx.Response, url: str, path: str, payload: dict[str, Any] | None,
               expect_json: bool) -> Any:
        if not 200 <= resp.status_code < 300:
            body = resp.text
            raise EngineReplyError(f"{url}{path} answered HTTP {resp.status_code}: {truncate(body)}",
                                   url=url, status_code=resp.status_code, body=truncate(body))
        data: Any = None
        if resp.content:
            try:
                data = resp.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                if expect_json:
                    raise EngineReplyError(f"{url}{path} answered HTTP {resp.status_code} with a body that "
                                           f"is not JSON: {truncate(resp.text)}", url=url,
                                           status_code=resp.status_code, body=truncate(resp.text)) from None
        elif expect_json:
            raise EngineReplyError(f"{url}{path} answered with an empty body", url=url,
                                   status_code=resp.status_code)
        if self.on_exchange is not None:
            self.on_exchange(path, payload, data)
        return data

    async def call(self, url: str, path: str, payload: dict[str, Any] | None = None, *,
                    method: str = "POST", expect_json: bool = False, timeout: float | None = None) -> Any:
        """A control/info call to one engine; an unreachable engine is marked unhealthy."""
        try:
            resp = await self.send_tracked(method, url, path, payload, timeout or self.control_timeout_s)
        except NeverAccepted as exc:
            self.mark_unhealthy(url, str(exc))
            raise EngineUnavailable(str(exc), url=url) from None
        except EngineUnavailable as exc:
            self.mark_unhealthy(url, str(exc))
            raise
        except EngineTimeout as exc:  # a control call never takes this long: the engine hangs (e.g. SIGSTOP)
            self.mark_unhealthy(url, str(exc))
            raise EngineUnavailable(f"{exc} (engine hung: left out until it is healthy again)", url=url) from None
        return self.check(resp, url, path, payload, expect_json)

    async def broadcast(self, path: str, payload: dict[str, Any] | None = None, *, method: str = "POST",
                         expect_json: bool = False, timeout: float | None = None,
                         urls: list[str] | None = None) -> dict[str, Any]:
        """The same control call to every healthy engine (or to ``urls``) at once; {url: reply}.

        Engines that cannot be reached are marked unhealthy and skipped; any
        other error is raised after all calls finished.
        """
        urls = self.router.healthy() if urls is None else urls
        if not urls:
            raise EngineUnavailable(f"{path}: no healthy engine among {list(self.router.urls)}")
        results = await asyncio.gather(
            *(self.call(u, path, payload, method=method, expect_json=expect_json, timeout=timeout)
              for u in urls), return_exceptions=True)
        replies, errors = {}, []
        for url, res in zip(urls, results):
            if isinstance(res, EngineUnavailable):
                continue
            if isinstance(res, BaseException):
                errors.append(res)
            else:
                replies[url] = res
        if errors:
            raise errors[0]
        if not replies:
            raise EngineUnavailable(f"{path}: every engine failed ({urls})")
        return replies
