"""rollout.weight_sync.overlap: the push of version v+1 runs in the background while the trainer goes on.

The scheduler tests drive the real AsyncScheduler against the fake engine of test_scheduler_logic
the way the overlapped trainer does: consume at the actor's version, update, then wait for the
previous push and start the next one without waiting for it. The publisher tests run the real
WeightPublisher (disk path, real DiskWeightSync writing safetensors) against a fake engine client.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
import torch.distributed as dist

from sao_megatron.config import ExperimentConfig
from sao_megatron.config.schema import DataConfig, RolloutConfig, SchedulerConfig
from test_scheduler_logic import FakeClient, make

pytestmark = pytest.mark.unit


async def overlapped_trainer(sched, client, steps: int, *, eta: int, batch: int, push_s: float,
                             train_s: float, judge_at_actor: bool = True, wait_ready: bool = True):
    """The trainer's order with overlap: batch → update (actor + 1) → wait for the previous push → start
    this one in the background. Returns [(actor version, served version, batch)] and the admission log."""
    admissions = []  # (num_started, bound from the version the engine serves) at every episode start
    real_generate = client.generate

    async def generate(*args, **kw):
        admissions.append((sched.num_started, (client.version + eta + 1) * batch))
        return await real_generate(*args, **kw)
    client.generate = generate
    actor, push, consumed = 0, None, []
    for _ in range(steps):
        got = await sched.next_batch(version=actor if judge_at_actor else None)
        consumed.append((actor, sched.version, got))
        await asyncio.sleep(train_s)  # the actor's update
        actor += 1
        if push is not None:
            await push  # at most one push in flight
        # Generation pauses during a push, so the next batch can be taken while this push is in flight
        # only if it finished before: wait for it (an event, not a time: beside a CPU hog, 1 run of the
        # 10-ms version took no batch during a push).
        if wait_ready:
            await asyncio.wait_for(_finished_at_least(sched, batch), timeout=60)

        async def load(v=actor):
            await asyncio.sleep(push_s)  # the engines load while the trainer goes on
            client.version = v
        push = asyncio.ensure_future(sched.on_weights_updated(actor, load))
    await push
    return consumed, admissions


async def _finished_at_least(sched, n: int) -> None:
    while sched._fifo.num_samples() < n:
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("eta", [1, 2])
def test_overlapped_pushes_keep_every_trained_token_within_the_staleness_limit(eta):
    """Samples are judged against the actor's version (counted here, not read from the code), which is
    one ahead of the served version while a push is in flight; admission keeps counting with the
    version the engines serve, so nothing admitted can exceed the limit; nothing is trained twice."""
    async def run():
        c = FakeClient(token_time=0.002, p_stop=0.1, seed=eta)
        s = make(c, eta=eta, concurrency=12, max_new_tokens=30)
        await s.start()
        out = await overlapped_trainer(s, c, 10, eta=eta, batch=4, push_s=0.2, train_s=0.01)
        await s.stop()
        return out
    consumed, admissions = asyncio.run(run())
    assert any(served < actor for actor, served, _ in consumed), "no batch was taken while a push was in flight"
    trained = []
    for actor, _, got in consumed:
        assert len(got) == 4
        for smp in got:
            vs = smp.action_versions
            assert vs and actor - min(vs) <= eta and max(vs) <= actor, (actor, vs)
            trained.append((smp.epoch, smp.index))
    assert len(trained) == len(set(trained))
    assert admissions and all(started <= bound for started, bound in admissions), admissions


def test_judging_staleness_at_the_served_version_would_train_stale_tokens():
    """The reference run for the test above: judged at the (lagging) served version, as the trainer did
    before the overlap, the same loop trains tokens older than the limit allows (so that test can fail)."""
    async def run():
        c = FakeClient(token_time=0.002, p_stop=0.1, seed=1)
        s = make(c, eta=1, concurrency=12, max_new_tokens=30)
        await s.start()
        out = await overlapped_trainer(s, c, 10, eta=1, batch=4, push_s=0.2, train_s=0.01, judge_at_actor=False,
                                         wait_ready=False)
        await s.stop()
        return out
    consumed, _ = asyncio.run(run())
    worst = max(actor - min(smp.action_versions) for actor, _, got in consumed for smp in got)
    assert worst > 1


# ---------------------------------------------------------------- the publisher's background push
@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A world of one gloo rank (publish and wait are collective)."""
    store = tmp_path_factory.mktemp("dist") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class DiskEngine(FakeClient):
    """The fake engine also loads weight directories (slowly), refusing the versions in ``refuse``."""

    def __init__(self, refuse=(), load_s=0.05):
        super().__init__()
        self.refuse, self.load_s, self.loaded = set(refuse), load_s, []

    async def update_weights_from_disk(self, model_path, *, weight_version):
        await asyncio.sleep(self.load_s)
        if weight_version in self.refuse:
            raise RuntimeError(f"engine refused {model_path}")
        self.loaded.append(weight_version)
        self.version = weight_version


def disk_publisher(tmp_path, monkeypatch, engine, *, overlap: bool):
    """A rank-0 WeightPublisher on the disk path, wired as ``start`` wires it, exporting one tensor."""
    from sao_megatron.weights.readmission import CurrentWeights
    from sao_megatron.weights.disk import DiskWeightSync
    from sao_megatron.weights import publisher as mod
    from sao_megatron.training.run.rollout_side import RolloutSide

    monkeypatch.setattr(mod, "export_weights", lambda c: iter([("w", torch.arange(6.0).reshape(2, 3))]))
    cfg = ExperimentConfig()
    cfg.rollout.weight_sync.overlap = overlap
    pub = mod.WeightPublisher(cfg, None, tmp_path, rank0=True)
    side = RolloutSide(rollout=RolloutConfig(), scheduler=SchedulerConfig(), data=DataConfig(), task=None,
                       mode="single", group_size=1, run_dir=tmp_path, template_dir=tmp_path)
    side.client, side.scheduler = engine, make(engine)
    pub.served = CurrentWeights(None, 0)
    side.scheduler._served = pub.served
    pub.rollout = side
    pub.disk = pub.transport = DiskWeightSync(client=engine, sync_root=tmp_path / "weights", template_dir=None,
                                              collective=False, verify=False)
    return pub


def test_a_failed_background_push_surfaces_at_the_next_publish_naming_its_version(tmp_path, monkeypatch,
                                                                                  one_rank):
    from sao_megatron.weights.publisher import WeightPushError

    engine = DiskEngine(refuse={2}, load_s=0.2)
    pub = disk_publisher(tmp_path, monkeypatch, engine, overlap=True)
    try:
        t0 = time.perf_counter()
        pub.publish(step=0)
        assert time.perf_counter() - t0 < 0.15  # returned before the engine finished loading
        assert pub.version == 1 and engine.loaded == []
        pub.publish(step=1)  # joins v1, starts v2
        (step, first), = pub.take_finished()  # v1's metrics, with the step that published it
        assert engine.loaded == [1] and step == 0 and first["rollout/weight_sync_bytes"] > 24  # 6 float32 + header
        assert pub.in_flight_step == 1 and pub.take_finished() == []
        with pytest.raises(WeightPushError, match=r"version 2 \(published after step 1\).*engine refused"):
            pub.publish(step=2)
        assert pub.served.version == 1 and engine.version == 1  # the engines kept serving v1
    finally:
        pub.close()
        pub.rollout.bridge.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_both_paths_leave_the_engines_serving_the_last_version(tmp_path, monkeypatch, one_rank, overlap):
    engine = DiskEngine(load_s=0.02)
    pub = disk_publisher(tmp_path, monkeypatch, engine, overlap=overlap)
    try:
        for step in range(3):
            pub.publish(step=step)
        pub.wait()
        assert engine.loaded == [1, 2, 3] and engine.version == pub.version == pub.served.version == 3
        assert (tmp_path / "weights" / "v000003" / "model.safetensors").is_file()
    finally:
        pub.close()
        pub.rollout.bridge.close()
