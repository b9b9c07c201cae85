"""Engine health: one probe that tells a working, a busy (paused/loading) and a dead engine apart,
and one poller that waits until engines answer.

SGLang's ``/health`` runs a one-token generation through the scheduler (0.5.23,
``http_server.health_generate`` behind ``/health``): it takes at least about a second
on a loaded engine, and on a paused engine it answers 503 after its own 20 s bound.
A short ``/health`` timeout therefore calls a paused or busy engine dead. The probe
asks ``/model_info`` first (served by the tokenizer manager without the scheduler,
answered while paused): no answer there means the process is gone or hung; an answer
there plus a failed ``/health`` on an engine we paused means busy, which is not a reason to drop it.

On an engine we did not pause, a failed ``/health`` is SGLang's own verdict that the scheduler or the
detokenizer produced nothing for 20 s (``Health check failed. Server couldn't get a response from
detokenizer``): ``STUCK``. ``/model_info`` keeps answering then, so it alone cannot see it; the
supervisor restarts an engine that is stuck on several probes in a row (``rollout.supervisor``).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence

import httpx

# Above SGLang's own 20 s /health bound on a paused engine, so a slow answer is not taken for death.
HEALTH_TIMEOUT_S = 30.0
INFO_TIMEOUT_S = 10.0


class EngineState(enum.Enum):
    OK = "ok"
    """/health answered 200."""
    BUSY = "busy"
    """Alive (/model_info answered) and paused by us, so /health was not asked (it would wait 20 s and fail)."""
    STUCK = "stuck"
    """Alive (/model_info answered) and not paused, but /health did not pass: scheduler or detokenizer hung
    (or, once, an engine slower than SGLang's 20 s bound)."""
    DEAD = "dead"
    """No answer at all: the process is gone, hung, or the address is wrong."""


def headers_for(api_key: str | None) -> dict[str, str]:
    """The HTTP headers every request to an engine or the router carries: SGLang's ``--api-key`` check
    (``Authorization: Bearer KEY``); none without a key. Built here only."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def probe(http: httpx.AsyncClient, base_url: str, *, paused: bool = False,
                health_timeout_s: float = HEALTH_TIMEOUT_S, info_timeout_s: float = INFO_TIMEOUT_S) -> EngineState:
    """One engine's state. ``paused``: the caller paused it, so /health (which would wait) is skipped: BUSY.

    No answer on /model_info within ``info_timeout_s``: DEAD (gone or hung, e.g. SIGSTOP); /health is
    then not asked, so a hung engine costs one short bound, not SGLang's 20 s."""
    base = base_url.rstrip("/")
    try:
        info_ok = (await http.get(f"{base}/model_info", timeout=info_timeout_s)).status_code == 200
    except httpx.HTTPError:
        return EngineState.DEAD
    if paused:
        return EngineState.BUSY if info_ok else EngineState.DEAD
    try:
        if (await http.get(f"{base}/health", timeout=health_timeout_s)).status_code == 200:
            return EngineState.OK
    except httpx.HTTPError:
        pass
    return EngineState.STUCK


def wait_healthy(urls: Sequence[str], *, timeout_s: float, what: str = "engine", api_key: str | None = None,
                 alive: Callable[[], bool] = lambda: True, on_dead: Callable[[], str] = lambda: "",
                 interval_s: float = 0.2) -> None:
    """Poll until every URL's ``/health`` answers 200.

    ``alive``: False once the local process serving the URLs exited (fail at once, with
    ``on_dead()``'s text, e.g. the log tail). TimeoutError naming the URLs still pending.
    """
    pending = [u.rstrip("/") for u in urls]
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, headers=headers_for(api_key)) as http:
        while True:
            pending = [u for u in pending if not _answers(http, u)]
            if not pending:
                return
            if not alive():
                raise RuntimeError(f"the local {what} process exited before {pending} became healthy. {on_dead()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not healthy after {timeout_s:.0f} s: {pending}. {on_dead()}")
            time.sleep(interval_s)


def _answers(http: httpx.Client, base: str) -> bool:
    try:
        return http.get(f"{base}/health", timeout=min(HEALTH_TIMEOUT_S, 10.0)).status_code == 200
    except httpx.HTTPError:
        return False
