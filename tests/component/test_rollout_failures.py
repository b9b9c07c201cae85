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
    with FakeEngine("slow", delay_s=5.0) as fake:
        start = time.perf_counter()
        exc, _ = generate([fake.url], timeout_s=0.5)
        elapsed = time.perf_counter() - start
    assert isinstance(exc, EngineTimeout) and elapsed < 3.0


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
    assert elapsed < 10
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
