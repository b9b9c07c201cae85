"""A connection lost in the middle of an overlapped distributed push does not leave a real SGLang 0.5.23
engine paused (issue 38: a two-engine run stalled at step 25 for good).

Two real servers; the client reaches engine 1 through a TCP relay, so a test can cut its connections
as a network or a server would. The scheduler generates, a trainer loop consumes batches while each
push (the distributed transport, on a thread, paused by the scheduler as the publisher does) runs
beside the next batch. During one push, once engine 1 is paused, every connection to it is cut: a
/generate held there by the pause is lost and the client marks engine 1 unhealthy before the continue.
Required: engine 1 itself generates again right after that push (it got its continue), the loop keeps
stepping, and the client routes to both engines again (the supervisor's /health probe readmits it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest
import torch

from sao_megatron.config.schema import SchedulerConfig
from sao_megatron.envs import ArithmeticTask
from sao_megatron.rollout.client import RolloutClient
from sao_megatron.weights.readmission import CurrentWeights, disk_readmit
from sao_megatron.rollout.supervisor import EngineSupervisor
from sao_megatron.rollout.types import SamplingParams
from sao_megatron.weights.distributed import DistributedWeightSync
from sao_megatron.scheduler import AsyncScheduler

pytestmark = pytest.mark.sglang
STEPS, CUT_AT = 6, 2  # the push of version CUT_AT loses engine 1's connections
SAMPLING = SamplingParams(max_new_tokens=24, temperature=1.0)
STEP_TIMEOUT_S = 180.0  # a batch takes seconds on 2 CPU cores; the stall held it for minutes (3 x 120 s)


class Relay:
    """A TCP relay to one port on loopback; ``cut()`` aborts every connection open through it."""

    def __init__(self, target: str):
        self.port = int(target.rsplit(":", 1)[1])
        self.open: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.open |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            dst.close()
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)
        self.open -= {writer, up_writer}

    def cut(self) -> int:
        """Reset every open connection (RST both ways); returns how many pairs were open."""
        pairs = len(self.open) // 2
        for w in list(self.open):
            w.transport.abort()
        return pairs

    async def close(self) -> None:
        self.cut()
        self.server.close()


def _weights(model_dir, scale: float) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    named = [(n, t) for f in sorted(model_dir.glob("*.safetensors")) for n, t in load_file(f).items()]
    return [(n, t * scale) for n, t in named]


async def _generates_directly(server, url: str, timeout_s: float = 60.0) -> bool:
    """Engine ``url`` answers a /generate itself (a paused engine holds it until continued)."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "rid": f"direct-{time.time()}"}
    async with httpx.AsyncClient(trust_env=False, headers=server.headers) as http:
        try:
            return (await http.post(url + "/generate", json=body, timeout=timeout_s)).status_code == 200
        except httpx.TimeoutException:
            return False


def test_a_connection_lost_mid_push_leaves_no_engine_paused_and_the_run_keeps_stepping(start_sglang_server):
    server = start_sglang_server("fp32", num_engines=2)
    url0, url1 = server.engines.urls
    sync = DistributedWeightSync(backend="gloo", master_address="127.0.0.1", api_key=server.api_key,
                                 strict_names=False, checkpoint_dtype="float32", bucket_bytes=1 << 20, timeout_s=120)
    sync.connect([url0, url1], is_sender=True)  # the weights go straight to the engines, as in production
    try:
        asyncio.run(_run(server, url0, url1, sync))
    finally:
        sync.close()


async def _run(server, url0: str, url1: str, sync: DistributedWeightSync) -> None:
    relay = Relay(url1)
    relayed = await relay.start()
    served = CurrentWeights(server.model_dir, 0)
    client = RolloutClient([url0, relayed], api_key=server.api_key, timeout_s=120, served=served)
    sched = AsyncScheduler(client, ArithmeticTask(num_prompts=400, seed=3),
                           SchedulerConfig(mode="single", batch_size=4, concurrency=8, max_staleness=2,
                                           partial_rollout="retract"),
                           SAMPLING, reward_workers=1, retry_backoff_s=0.05)
    sup = EngineSupervisor(client, [url0, relayed], readmit=disk_readmit(client, served), restart_budget=0,
                           no_engine_timeout_s=600, interval_s=1.0, api_key=server.api_key)
    loop = asyncio.get_running_loop()
    cuts: list[int] = []

    def push(version: int) -> None:  # the publisher's overlapped push thread
        async def locked(update) -> None:
            async with served.lock:
                served.pending = version
                try:
                    if version == CUT_AT:
                        cuts.append(relay.cut())  # engine 1 is paused here, its held /generate requests die
                        await asyncio.sleep(0.5)  # the turns see it and mark engine 1 unhealthy first
                    await update()
                    served.set(None, version)
                finally:
                    served.pending = None

        def paused(update) -> None:
            asyncio.run_coroutine_threadsafe(sched.on_weights_updated(version, lambda: locked(update)), loop).result()
        sync.push(_weights(server.model_dir, 1.0 + 0.01 * version), version, paused=paused)

    await sched.start()
    watching = asyncio.create_task(sup.run())
    try:
        await asyncio.wait_for(sched.next_batch(), STEP_TIMEOUT_S)
        for version in range(1, STEPS + 1):
            if version == CUT_AT:  # a request open on engine 1 when the push pauses it
                await _until(lambda: client._router.inflight.get(relayed, 0) > 0, 60)
            pushing = asyncio.ensure_future(asyncio.to_thread(push, version))
            await asyncio.wait_for(sched.next_batch(version=version), STEP_TIMEOUT_S)  # trains beside the push
            await asyncio.wait_for(pushing, STEP_TIMEOUT_S)
            if version == CUT_AT:
                assert cuts and cuts[0] > 0, "no connection to engine 1 was open when it was cut"
                assert await _generates_directly(server, url1), "engine 1 was left paused by the push"
        await _until(lambda: relayed in client.healthy_urls(), 60)  # readmitted by the supervisor's probe
        engines = {(await client.generate([5, 6, 7], SAMPLING)).engine_url for _ in range(8)}
        assert engines == {url0, relayed}, f"replies came only from {engines}"
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await sched.stop()
        await sup.aclose()
        await client.aclose()
        await relay.close()


async def _until(cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)
