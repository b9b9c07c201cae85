"""Failure modes of the client against misbehaving loopback servers: typed errors, no hangs."""

from __future__ import annotations

import asyncio
import time

import pytest
from rollout_fixtures import FakeEngine

from sao_megatron.rollout import (
    EngineReplyError,
    EngineTimeout,
    EngineUnavailable,
    RolloutClient,
    SamplingParams,
)
from sao_megatron.net import free_port

pytestmark = pytest.mark.component

SP = SamplingParams(max_new_tokens=2)


def generate(urls, **kw):
    async def run():
        async with RolloutClient(urls, timeout_s=kw.pop("timeout_s", 5.0), retry_backoff_s=0.05, **kw) as client:
            try:
                return await client.generate([1, 2], SP), client.healthy_urls()
            except Exception as exc:  # hand the error and the health view back to the test
                return exc, client.healthy_urls()
    return asyncio.run(run())


@pytest.mark.parametrize("mode,error,status", [("malformed", EngineReplyError, 200),
                                               ("http500", EngineReplyError, 500),
                                               ("wrong_lengths", EngineReplyError, None)])
def test_bad_replies_are_typed_errors(mode, error, status):
    with FakeEngine(mode) as fake:
        exc, healthy = generate([fake.url])
    assert isinstance(exc, error), exc
    if status is not None:
        assert exc.status_code == status
    assert len(str(exc)) < 1500  # the body is truncated in the message
    assert healthy == [fake.url]  # a bad reply is not a dead engine


def test_slow_reply_times_out_without_hanging():
    with FakeEngine("slow", delay_s=60.0) as fake:
        start = time.perf_counter()
        exc, _ = generate([fake.url], timeout_s=0.5)
        elapsed = time.perf_counter() - start
    # ~0.6 s measured; 15 s leaves 25x for a loaded machine and is still far from the 60 s reply.
    assert isinstance(exc, EngineTimeout) and elapsed < 15.0


def test_dropped_connection_marks_engine_unhealthy():
    with FakeEngine("drop") as fake:
        exc, healthy = generate([fake.url])
    assert isinstance(exc, EngineUnavailable) and healthy == []


def test_connection_refused_retries_then_fails_over():
    dead = f"http://127.0.0.1:{free_port()}"
    with FakeEngine("ok") as fake:
        start = time.perf_counter()
        # Pin the choice: with the dead engine first and equal load, the router tries it first half the time;
        # run twice so both orders occur, and every run must end on the live engine.
        outcomes = [generate([dead, fake.url], max_connect_retries=2) for _ in range(4)]
        elapsed = time.perf_counter() - start
    for result, healthy in outcomes:
        assert result.output_ids == [7, 8] and result.engine_url == fake.url
    assert any(healthy == [fake.url] for _, healthy in outcomes)  # the refused engine was marked unhealthy
    # Refused connections fail fast (0.05 s backoff): the 4 calls took 1.8 s under load; waiting
    # for the 5 s request timeout each would take 20 s. 15 s is an 8x margin below that.
    assert elapsed < 15
    exc, healthy = generate([dead], max_connect_retries=2)
    assert isinstance(exc, EngineUnavailable) and healthy == []


def test_control_broadcast_skips_dead_engines():
    dead = f"http://127.0.0.1:{free_port()}"

    async def run():
        async with RolloutClient([fake.url, dead], max_connect_retries=1, retry_backoff_s=0.01) as client:
            await client.pause_generation("retract")  # the live engine answers; the dead one is dropped
            healthy = client.healthy_urls()
            health = await client.health()
            return healthy, health
    with FakeEngine("ok") as fake:
        healthy, health = asyncio.run(run())
    assert healthy == [fake.url] and health == {fake.url: True, dead: False}


def _hung_server():
    """A listening socket that never accepts: connections complete in the kernel backlog and the
    request is sent, but no reply ever comes, as from a SIGSTOPped engine."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_an_engine_taken_out_of_service_releases_the_calls_waiting_on_it():
    """The supervisor judged an engine hung and removed it: a pause broadcast and a turn that wait
    on it end at once (the broadcast with the other engine's reply, the turn with EngineUnavailable
    for its episode to fail over) instead of after the 60 s control/request timeouts."""
    hung, hung_url = _hung_server()

    async def run(ok_url):
        async with RolloutClient([ok_url, hung_url], timeout_s=60.0, control_timeout_s=60.0) as client:
            pause = asyncio.ensure_future(client._broadcast("/pause_generation", {"mode": "abort"}))
            turn = asyncio.ensure_future(client._generate_at(hung_url, {"rid": "r1"}, "r1", False, via_router=False))
            await asyncio.sleep(0.5)
            assert not pause.done() and not turn.done()  # both wait on the hung engine
            start = time.perf_counter()
            client.remove_engine(hung_url)
            replies = await asyncio.wait_for(pause, 30)
            with pytest.raises(EngineUnavailable, match="taken out of service"):
                await asyncio.wait_for(turn, 30)
            return replies, time.perf_counter() - start, client.healthy_urls(), client._open_sends
    try:
        with FakeEngine("ok") as fake:
            replies, elapsed, healthy, open_sends = asyncio.run(run(fake.url))
    finally:
        hung.close()
    # Released at once (measured < 0.1 s), not after the 60 s timeouts; 20 s is a >100x margin.
    assert list(replies) == [fake.url] and elapsed < 20.0
    assert healthy == [fake.url] and not any(open_sends.values())


def test_a_caller_cancelled_call_stays_cancelled():
    """Cancelling a caller (say, at shutdown) is not turned into an engine failure."""
    hung, hung_url = _hung_server()

    async def run():
        async with RolloutClient([hung_url], timeout_s=60.0, control_timeout_s=60.0) as client:
            call = asyncio.ensure_future(client._call(hung_url, "/pause_generation", {"mode": "abort"}))
            await asyncio.sleep(0.3)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            return client.healthy_urls()
    try:
        assert asyncio.run(run()) == [hung_url]
    finally:
        hung.close()
