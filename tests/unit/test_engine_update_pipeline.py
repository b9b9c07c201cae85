"""The embedded engine's ``/update_weights_from_distributed`` route, pipelined: a plain bucket is answered
once received while its load waits on the engine thread, and nothing is ever lost or reordered.

The route runs in-process over stand-ins for the engine thread and the group receive, driven through
its real HTTP app, so the order of receives, loads and replies can be held and observed.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from fastapi import FastAPI

from sao_megatron.rollout.engine.weight_routes import WeightRoutes

pytestmark = pytest.mark.unit


class Core:
    """The engine thread as the route sees it: ``call`` runs commands one at a time, in order."""

    def __init__(self):
        self.weight_version, self.running, self.waiting, self.paused = "0", [], [], "retract"
        self.in_weight_update = False
        self.queue: asyncio.Queue = asyncio.Queue()
        self.worker = asyncio.ensure_future(self._run())

    async def _run(self):
        while True:
            fn, fut = await self.queue.get()
            try:
                fut.set_result(await asyncio.to_thread(fn))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

    async def call(self, fn):
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((fn, fut))
        return await fut

    def abort_all(self, why):
        pass


class Weights:
    """Receives bucket ``n`` as one tensor filled with ``n`` (into the slot the route names) and loads by
    recording what it finds in the slot then; ``hold`` blocks the load of one bucket."""

    def __init__(self, hold: int | None = None, fail: int | None = None):
        import threading

        self.slots = [torch.zeros(4), torch.zeros(4)]
        self.events: list[tuple[str, int]] = []
        self.loaded: list[float] = []
        self.hold, self.fail = hold, fail
        self.release = threading.Event()

    def receive(self, names, dtypes, shapes, group, load_format, slot=0):
        n = int(names[0])
        self.events.append(("receive", n))
        self.slots[slot].fill_(n)
        return [(names[0], self.slots[slot])]

    def check_loadable(self, named):
        pass

    def load(self, named):
        n = int(named[0][0])
        if n == self.hold:
            assert self.release.wait(10)
        self.events.append(("load", n))
        if n == self.fail:
            raise RuntimeError(f"load {n} broke")
        self.loaded.append(float(named[0][1][0]))


def update(n: int, version: str | None = None) -> dict:
    body = {"names": [str(n)], "dtypes": ["float32"], "shapes": [[4]], "group_name": "g",
            "load_format": "flattened_bucket", "flush_cache": version is not None, "abort_all_requests": False}
    return body | ({"weight_version": version} if version else {})


async def serve(weights: Weights):
    core = Core()
    routes = WeightRoutes(core, weights)
    app = FastAPI()
    for path, handler, methods in routes.routes():
        app.add_api_route(path, handler, methods=methods)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine")
    return core, http


def test_buckets_load_in_order_and_the_version_waits_for_all():
    async def run():
        weights = Weights()
        core, http = await serve(weights)
        assert (await http.post("/begin_weight_update", json={})).json()["success"]
        for n in range(1, 6):
            assert (await http.post("/update_weights_from_distributed", json=update(n))).status_code == 200
        reply = await http.post("/update_weights_from_distributed", json=update(6, "7"))
        assert reply.json()["success"] and core.weight_version == "7"
        assert (await http.post("/end_weight_update", json={})).json()["success"]
        return weights
    weights = asyncio.run(run())
    assert weights.loaded == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # each load found its own bucket's bytes
    assert [n for kind, n in weights.events if kind == "load"] == [1, 2, 3, 4, 5, 6]


def test_next_bucket_is_received_while_one_loads_but_never_into_its_buffer():
    async def run():
        weights = Weights(hold=1)
        _, http = await serve(weights)
        await http.post("/begin_weight_update", json={})
        first = await http.post("/update_weights_from_distributed", json=update(1))
        assert first.json()["success"]  # answered while its load is held
        second = await http.post("/update_weights_from_distributed", json=update(2))
        assert second.json()["success"] and ("receive", 2) in weights.events
        third = asyncio.ensure_future(http.post("/update_weights_from_distributed", json=update(3)))
        await asyncio.sleep(0.3)
        assert ("receive", 3) not in weights.events  # bucket 1's buffer is still being loaded
        weights.release.set()
        assert (await third).json()["success"]
        assert (await http.post("/end_weight_update", json={})).json()["success"]
        return weights
    weights = asyncio.run(run())
    assert weights.loaded == [1.0, 2.0, 3.0]
    assert weights.events.index(("load", 1)) < weights.events.index(("receive", 3))


def test_a_failed_load_fails_the_version_call_and_the_session_end():
    async def run():
        weights = Weights(fail=2)
        core, http = await serve(weights)
        await http.post("/begin_weight_update", json={})
        for n in (1, 2):
            assert (await http.post("/update_weights_from_distributed", json=update(n))).json()["success"]
        last = await http.post("/update_weights_from_distributed", json=update(3, "9"))
        assert last.status_code == 400 and "Failed to update parameter online: load 2 broke" in last.json()["message"]
        assert core.weight_version == "0"  # never recorded over a partial load
        await http.post("/update_weights_from_distributed", json=update(4, None) | {"names": ["2"]})
        end = await http.post("/end_weight_update", json={})
        assert end.status_code == 400 and "load 2 broke" in end.json()["message"]
        again = await http.post("/begin_weight_update", json={})  # the session did end
        assert again.json()["success"]
    asyncio.run(run())
