"""A router's worker list over its HTTP API (sglang-router 0.3.2 and the SGLang Model Gateway ``smg``).

Measured (``benchmarks/router_dead_worker.py``): both accept ``POST /workers {"url": ...}`` (HTTP 202,
registered asynchronously) and list workers at ``GET /workers`` (``{"workers": [{"id", "url", ...}]}``);
removal is ``DELETE /workers/{id}`` by the worker's id from that listing (a URL in its place is refused
with HTTP 400). Adding a URL the router already lists is accepted and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import quote

import httpx

from sao_megatron.rollout.health import headers_for

logger = logging.getLogger(__name__)


class RouterAdmin:
    """Remove and add workers of the router at ``url`` (``rollout.supervisor.RouterWorkers``)."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 10.0,
                 settle_s: float = 10.0):
        """``settle_s``: how long ``add``/``remove`` wait for the listing to show the change."""
        self.url = url.rstrip("/")
        self.timeout_s, self.settle_s = timeout_s, settle_s
        self.headers = headers_for(api_key)

    async def workers(self, http: httpx.AsyncClient) -> list[dict]:
        reply = await http.get(self.url + "/workers")
        reply.raise_for_status()
        return list(reply.json().get("workers", []))

    async def remove(self, url: str) -> None:
        """Take ``url`` out of the router (no-op if it is not listed)."""
        url = url.rstrip("/")
        async with httpx.AsyncClient(trust_env=False, timeout=self.timeout_s, headers=self.headers) as http:
            for w in await self.workers(http):
                if str(w.get("url", "")).rstrip("/") == url:
                    wid = w.get("id") or w.get("worker_id") or url
                    resp = await http.delete(self.url + "/workers/" + quote(str(wid), safe=""))
                    if resp.status_code >= 300:
                        raise RuntimeError(f"router {self.url} refused to remove {url} (id {wid}): "
                                           f"HTTP {resp.status_code} {resp.text[:200]}")
            await self._settle(http, url, present=False)

    async def add(self, url: str) -> None:
        """Register ``url`` with the router and wait until it is listed."""
        url = url.rstrip("/")
        async with httpx.AsyncClient(trust_env=False, timeout=self.timeout_s, headers=self.headers) as http:
            resp = await http.post(self.url + "/workers", json={"url": url})
            if resp.status_code >= 300:
                raise RuntimeError(f"router {self.url} refused to add {url}: HTTP {resp.status_code} "
                                   f"{resp.text[:200]}")
            await self._settle(http, url, present=True)

    async def _settle(self, http: httpx.AsyncClient, url: str, *, present: bool) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settle_s
        while loop.time() < deadline:
            listed = {str(w.get("url", "")).rstrip("/") for w in await self.workers(http)}
            if (url in listed) == present:
                return
            await asyncio.sleep(0.2)
        logger.warning("router %s still %s %s after %.0f s", self.url, "lacks" if present else "lists", url,
                       self.settle_s)
