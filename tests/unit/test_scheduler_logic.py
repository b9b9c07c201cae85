"""Scheduler logic against an in-process fake engine client (no HTTP): admission rule, FIFO,
staleness drops, group/sync modes, partial-rollout modes, engine failure, resume, metrics.

The real-engine versions of the key properties are in tests/component/test_scheduler_engine.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from sao_megatron.config.schema import SchedulerConfig
from sao_megatron.envs import ArithmeticTask, CalculatorTask, CharTokenizer
from sao_megatron.rollout.types import EngineUnavailable, GenerateResult, SamplingParams
from sao_megatron.scheduler import AsyncScheduler, PromptCursor, Sample, collate

pytestmark = pytest.mark.unit
TOK = CharTokenizer()


class FakeClient:
    """Duck-typed RolloutClient: one token per ``token_time`` s, the current version per token,
    log-prob ``-0.01*(1+version) - 1e-4*token`` (so a test can tell which weights made a token),
    pause modes abort/retract like SGLang, optional scripted outputs and injected failures."""

    def __init__(self, *, token_time=0.001, p_stop=0.25, script=None, seed=0, fail_after=None, hold=False):
        self.engine_urls = ["fake://0"]
        self.version = 0
        self.token_time, self.p_stop, self.script = token_time, p_stop, script
        self.rng = random.Random(seed)
        self.running = asyncio.Event()
        self.running.set()
        self.hold = asyncio.Event()
        if not hold:
            self.hold.set()
        self.mode = None
        self.aborted: set[str] = set()
        self.num_requests = self.open = 0
        self.fail_after = fail_after  # rid -> token count after which the "engine" dies
        self.inputs: list[list[int]] = []

    def healthy_urls(self):
        return self.engine_urls

    def engine_of(self, rid):
        return self.engine_urls[0] if self.engine_urls else None

    async def health(self):
        return {u: True for u in self.engine_urls}

    async def generate(self, input_ids, sampling, *, rid=None, return_routed_experts=False, avoid=frozenset()):
        self.num_requests += 1
        self.open += 1
        self.inputs.append(list(input_ids))
        try:
            await self.hold.wait()
            return await self._gen(list(input_ids), sampling, rid)
        finally:
            self.open -= 1

    async def _gen(self, input_ids, sampling, rid):
        plan = self.script(input_ids) if self.script else None
        out, lps, vers = [], [], []
        t0, finish = time.monotonic(), "length"
        for i in range(sampling.max_new_tokens):
            while not self.running.is_set():
                if self.mode == "abort":
                    return self._res(rid, out, lps, vers, "abort", input_ids, t0)
                await self.running.wait()
            await asyncio.sleep(self.token_time)
            if rid in self.aborted:
                return self._res(rid, out, lps, vers, "abort", input_ids, t0)
            if self.fail_after and self.fail_after(rid, i):
                raise EngineUnavailable("fake engine died mid-request", url="fake://0")
            if plan is not None:
                tok = plan[i] if i < len(plan) else TOK.eos_id
            else:
                tok = TOK.eos_id if self.rng.random() < self.p_stop else self.rng.randrange(20, 40)
            out.append(tok)
            vers.append(self.version)
            lps.append(-0.01 * (1 + self.version) - 1e-4 * tok)
            if tok in sampling.stop_token_ids:
                finish = "stop"
                break
        return self._res(rid, out, lps, vers, finish, input_ids, t0)

    def _res(self, rid, out, lps, vers, finish, input_ids, t0):
        return GenerateResult(rid=rid, output_ids=out, logprobs=lps, versions=vers, finish_reason=finish,
                              prompt_tokens=len(input_ids), weight_version=self.version, routed_experts=None,
                              engine_url="fake://0", latency_s=time.monotonic() - t0)

    async def pause_generation(self, mode="retract"):
        self.mode = mode
        self.running.clear()

    async def continue_generation(self):
        self.running.set()

    async def abort_request(self, rid):
        self.aborted.add(rid)

    async def abort_all(self):
        pass


def make(client, *, mode="single", batch_size=4, concurrency=16, eta=1, partial="retract", group_size=1,
         task=None, max_new_tokens=12, **kw):
    cfg = SchedulerConfig(mode=mode, batch_size=batch_size, concurrency=concurrency, max_staleness=eta,
                          partial_rollout=partial)
    return AsyncScheduler(client, task or ArithmeticTask(num_prompts=kw.pop("num_prompts", 64)), cfg,
                          SamplingParams(max_new_tokens=max_new_tokens), group_size=group_size,
                          reward_workers=1, retry_backoff_s=0.01, **kw)


async def settle(n=20):
    for _ in range(n):
        await asyncio.sleep(0)


async def train_loop(sched, client, steps, *, update_sleep=0.01, between=0.0):
    """Consume ``steps`` batches, bumping the version after each (weights 'pushed' during the pause)."""
    consumed = []
    for _ in range(steps):
        batch = await sched.next_batch()
        consumed.append((sched.version, batch))
        await asyncio.sleep(between)

        async def push(v=sched.version + 1):
            await asyncio.sleep(update_sleep)  # in-flight requests really see the pause
            client.version = v
        await sched.on_weights_updated(sched.version + 1, push)
    return consumed


def issued_refs(state) -> list[tuple[int, int]]:
    """Every (epoch, index) the cursor handed out so far, from a slow re-derivation of its order."""
    c = state["cursor"]
    ref = PromptCursor(c["num_prompts"], seed=c["seed"], shuffle=c["shuffle"])
    out = []
    for e in range(c["epoch"] + 1):
        order = ref._epoch_order(e)
        out += [(e, i) for i in (order if e < c["epoch"] else order[:c["position"]])]
    return out


def pending_refs(state) -> list[tuple[int, int]]:
    return ([(e, i) for e, i, _ in state["cursor"]["requeued"]]
            + [(d["epoch"], d["index"]) for unit in state["fifo"] for d in unit[:1]])


# ---------------------------------------------------------------- admission rule


@pytest.mark.parametrize("eta,group,expect", [(0, 1, 4), (1, 1, 8), (3, 1, 16), (1, 2, 8)])
def test_admission_stops_at_v_plus_eta_plus_one_batches(eta, group, expect):
    async def run():
        c = FakeClient(hold=True)
        s = make(c, mode="group" if group > 1 else "single", eta=eta, group_size=group, concurrency=100)
        await s.start()
        await settle()
        assert (s.num_started, c.open) == (expect, expect)
        s.set_version(1)  # one more batch of budget
        await settle()
        assert (s.num_started, c.open) == (expect + 4, expect + 4)
        await s.stop()
    asyncio.run(run())


def test_concurrency_caps_episodes_in_flight():
    async def run():
        c = FakeClient(hold=True)
        s = make(c, eta=10, concurrency=5)
        await s.start()
        await settle()
        assert c.open == 5 and s.num_started == 5
        await s.stop()
    asyncio.run(run())


def test_deadlock_is_reported_not_hung():
    async def run():
        c = FakeClient()
        s = make(c, eta=0)
        await s.start()
        await s.next_batch()  # consumes the only admissible batch at v=0
        with pytest.raises(RuntimeError, match="set_version"):
            await asyncio.wait_for(s.next_batch(), 5)
        s.reset_admission_budget()  # value pretraining: consume without a new version
        assert len(await s.next_batch()) == 4
        await s.stop()
    asyncio.run(run())


# ---------------------------------------------------------------- staleness + exactly-once


@pytest.mark.parametrize("eta", [0, 1, 2])
@pytest.mark.parametrize("partial", ["retract", "abort"])
def test_stream_of_updates_respects_staleness_and_loses_nothing(eta, partial):
    async def run():
        c = FakeClient(token_time=0.002, p_stop=0.08, seed=eta)
        s = make(c, eta=eta, partial=partial, concurrency=12, max_new_tokens=40)
        await s.start()
        consumed = await train_loop(s, c, 8)
        state = s.state_dict()
        await s.stop()
        return consumed, state, s
    consumed, state, s = asyncio.run(run())
    trained = []
    for v, batch in consumed:
        assert len(batch) == 4
        for smp in batch:
            vs = smp.action_versions
            assert vs and min(vs) >= v - eta and max(vs) <= v, (v, vs)  # audit every token
            assert all(x == -1 for x, m in zip(smp.versions, smp.action_mask) if not m)
            # each token's log-prob is the one of the version that produced it
            assert smp.rollout_logprobs == pytest.approx(
                [-0.01 * (1 + x) - 1e-4 * t for x, t in zip(smp.versions, smp.response_ids)])
            trained.append((smp.epoch, smp.index))
    assert len(trained) == len(set(trained)) == 32  # never twice
    issued = issued_refs(state)
    assert sorted(trained + pending_refs(state)) == sorted(issued)  # never lost (in flight -> requeued)
    json.dumps(state)
    if eta == 0:
        assert state["counters"]["dropped_stale"] == 0  # on-policy: nothing is generated ahead


def test_stale_samples_are_dropped_and_requeued():
    async def run():
        c = FakeClient(token_time=0.001, p_stop=0.0)
        s = make(c, eta=1, batch_size=2, concurrency=8, max_new_tokens=5)
        await s.start()
        while len(s._fifo) < 4:  # 4 finished samples of version 0 wait in the FIFO
            await asyncio.sleep(0.005)
        old = [(u[0].epoch, u[0].index) for u in s._fifo]
        c.version = 3
        s.set_version(3)  # three updates later, everything in the FIFO is too old (0 < 3 - 1)
        batch = await s.next_batch()
        state = s.state_dict()
        m = s.metrics()
        await s.stop()
        return old, batch, state, m
    old, batch, state, m = asyncio.run(run())
    assert all(min(x.action_versions) >= 2 for x in batch)
    assert m["rollout/dropped_stale"] >= len(old) >= 4
    trained = [(x.epoch, x.index) for x in batch]
    assert set(old) <= set(trained + pending_refs(state))  # re-queued (or already re-run), not lost
    assert sorted(trained + pending_refs(state)) == sorted(issued_refs(state))


# ---------------------------------------------------------------- modes


def test_group_mode_releases_only_complete_groups():
    async def run():
        c = FakeClient(token_time=0.001, p_stop=0.15)
        s = make(c, mode="group", group_size=4, batch_size=8, concurrency=12, max_new_tokens=30)
        await s.start()
        batches = [b for _, b in await train_loop(s, c, 4)]
        await s.stop()
        return batches
    for batch in asyncio.run(run()):
        groups: dict[int, list[Sample]] = {}
        for smp in batch:
            groups.setdefault(smp.group_id, []).append(smp)
        assert len(groups) == 2 and all(len(g) == 4 for g in groups.values())
        assert all(len({(x.epoch, x.index) for x in g}) == 1 for g in groups.values())
        lengths = {len(x.response_ids) for g in groups.values() for x in g}
        assert len(lengths) > 1  # members really finished at different times


def test_sync_mode_generates_nothing_while_training():
    async def run():
        c = FakeClient(token_time=0.001, p_stop=0.2)
        s = make(c, mode="sync", eta=3, concurrency=16)
        await s.start()
        await asyncio.sleep(0.02)
        assert c.num_requests == 0  # nothing before the trainer asks
        for step in range(3):
            batch = await s.next_batch()
            assert all(set(x.action_versions) == {step} for x in batch)
            n = c.num_requests
            await asyncio.sleep(0.03)  # "training"
            assert c.num_requests == n and c.open == 0
            c.version = step + 1
            await s.on_weights_updated(step + 1)
        await s.stop()
    asyncio.run(run())


def test_abort_mode_resubmits_prompt_plus_partial_tokens():
    async def run():
        c = FakeClient(token_time=0.003, p_stop=0.0)
        s = make(c, partial="abort", concurrency=4, max_new_tokens=20)
        await s.start()
        await asyncio.sleep(0.02)  # a few tokens in

        async def push():
            await asyncio.sleep(0.01)
            c.version = 1
        await s.on_weights_updated(1, push)
        batch = await s.next_batch()
        m = s.metrics()
        await s.stop()
        return batch, c, m
    batch, c, m = asyncio.run(run())
    mixed = [x for x in batch if len(set(x.versions)) == 2]
    assert mixed and m["rollout/interrupted"] >= 1 and m["rollout/resumed"] >= 1
    for x in batch:
        assert len(x.response_ids) == 20 and x.finish_reason == "length"  # budget spans segments
        assert x.versions == sorted(x.versions)
    # the resubmission carried prompt + the partial tokens of the first segment
    x = mixed[0]
    cut = x.versions.index(1)
    assert x.prompt_ids + x.response_ids[:cut] in c.inputs


def test_discard_mode_drops_interrupted_generations_and_requeues():
    async def run():
        c = FakeClient(token_time=0.003, p_stop=0.0)
        s = make(c, partial="discard", concurrency=4, max_new_tokens=20)
        await s.start()
        await asyncio.sleep(0.02)

        async def push():
            await asyncio.sleep(0.01)
            c.version = 1
        await s.on_weights_updated(1, push)
        batch = await s.next_batch()
        state = s.state_dict()
        await s.stop()
        return batch, state
    batch, state = asyncio.run(run())
    assert state["counters"]["discarded"] == 4
    assert all(set(x.versions) == {1} for x in batch)
    assert all(x.attempt == 2 for x in batch)  # the discarded prompts came back first
    trained = [(x.epoch, x.index) for x in batch]
    assert sorted(trained + pending_refs(state)) == sorted(issued_refs(state))


def test_engine_death_resubmits_with_the_partial_tokens_kept():
    dead = set()

    def fail_after(rid, i):  # the first request of every episode dies after 3 tokens
        if rid.endswith("1".rjust(16, "0")) and i == 3 and rid not in dead:
            dead.add(rid)
            return True
        return False

    async def run():
        c = FakeClient(token_time=0.001, p_stop=0.0, fail_after=fail_after)
        s = make(c, concurrency=4, max_new_tokens=10)
        await s.start()
        batch = await s.next_batch()
        m = s.metrics()
        await s.stop()
        return batch, m, c
    batch, m, c = asyncio.run(run())
    assert m["rollout/engine_retries"] >= 4
    for x in batch:  # the dead segment's 3 tokens were never returned: 10 fresh tokens after the prompt
        assert len(x.response_ids) == 10
        assert c.inputs.count(x.prompt_ids) >= 2  # resubmitted from the last completed segment


# ---------------------------------------------------------------- multi-turn, rewards


def calculator_script(tok: CharTokenizer, task: CalculatorTask):
    answers = {tuple(p.input_ids): p.meta for p in task.prompts()}

    def script(input_ids):
        if tok.obs_end_id in input_ids:  # second turn: answer
            meta = next(v for k, v in answers.items() if input_ids[:len(k)] == list(k))
            return tok.encode(meta["answer"]) + [tok.eos_id]
        meta = answers[tuple(input_ids)]
        return [tok.call_id] + tok.encode(meta["prompt"].rstrip("=")) + [tok.call_end_id]
    return script


@pytest.mark.component  # the calculator runs in the sandbox (real subprocesses)
def test_multi_turn_masks_observations_and_places_rewards():
    task = CalculatorTask(num_prompts=8, options={"max_operand": 99})

    async def run():
        c = FakeClient(token_time=0.0005, script=calculator_script(TOK, task))
        s = make(c, task=task, batch_size=4, max_turns=3, max_new_tokens=32)
        await s.start()
        batch = await s.next_batch()
        await s.stop()
        return batch
    for x in asyncio.run(run()):
        meta = task.prompts()[x.index].meta
        call = [TOK.call_id] + TOK.encode(meta["prompt"].rstrip("=")) + [TOK.call_end_id]
        obs = [TOK.obs_id] + TOK.encode(meta["answer"]) + [TOK.obs_end_id]
        final = TOK.encode(meta["answer"]) + [TOK.eos_id]
        assert x.response_ids == call + obs + final
        assert x.action_mask == [1] * len(call) + [0] * len(obs) + [1] * len(final)
        assert x.turn_spans == [[0, len(call)], [len(call) + len(obs), len(x.response_ids)]]
        assert [v for v, m in zip(x.versions, x.action_mask) if not m] == [-1] * len(obs)
        assert [lp for lp, m in zip(x.rollout_logprobs, x.action_mask) if not m] == [0.0] * len(obs)
        assert x.reward == 1.0 and x.turn_rewards == [0.1, 0.0]
        expect = [0.0] * len(x.response_ids)
        expect[len(call) - 1], expect[-1] = 0.1, 1.0
        assert x.token_rewards() == pytest.approx(expect)


class _BrokenRewardTask(ArithmeticTask):
    def reward_call(self, prompt, trajectory_ids, action_mask, target):
        if prompt.index % 3 == 0:
            return int, ("not a number",)  # raises in the worker
        if prompt.index % 3 == 1:
            return time.sleep, (30,)  # exceeds the limit
        return super().reward_call(prompt, trajectory_ids, action_mask, target)


def test_reward_exceptions_and_timeouts_give_zero_and_the_run_goes_on():
    async def run():
        c = FakeClient()
        s = make(c, task=_BrokenRewardTask(num_prompts=12), batch_size=6, concurrency=6, eta=5,
                 reward_timeout_s=0.5, shuffle=False)
        await s.start()
        batches = [await s.next_batch(), await s.next_batch()]
        await s.stop()
        return [x for b in batches for x in b]
    samples = asyncio.run(run())
    assert len(samples) == 12
    for x in samples:
        if x.index % 3 == 0:
            assert x.reward == 0.0 and x.reward_error.startswith("exception: ValueError")
        elif x.index % 3 == 1:
            assert x.reward == 0.0 and x.reward_error.startswith("timeout")
        else:
            assert x.reward_error is None


# ---------------------------------------------------------------- resume, metrics, collate


def test_state_dict_round_trip_resumes_exactly_once():
    async def first():
        c = FakeClient(token_time=0.002, p_stop=0.1, seed=1)
        s = make(c, eta=2, concurrency=8, max_new_tokens=30, num_prompts=20)
        await s.start()
        consumed = await train_loop(s, c, 3)
        while not any(min(u[0].action_versions) >= s.version - 2 for u in s._fifo):  # one fresh sample waits
            await asyncio.sleep(0.002)
        state = json.loads(json.dumps(s.state_dict()))  # what a checkpoint stores
        await s.stop()
        return consumed, state

    async def second(state):
        c = FakeClient(token_time=0.002, p_stop=0.1, seed=2)
        c.version = state["version"]
        s = make(c, eta=2, concurrency=8, max_new_tokens=30, num_prompts=20)
        s.load_state_dict(state)
        assert s.num_started == state["counters"]["trained"] + sum(len(u) for u in state["fifo"])
        await s.start()
        consumed = await train_loop(s, c, 5)  # crosses into epoch 1
        final = s.state_dict()
        await s.stop()
        return consumed, final

    c1, state = asyncio.run(first())
    c2, final = asyncio.run(second(state))
    fresh = [Sample.from_dict(d) for unit in state["fifo"] for d in unit
             if min(d["versions"][i] for i, m in enumerate(d["action_mask"]) if m) >= state["version"] - 2]
    fresh.sort(key=lambda x: x.oldest_version())  # consume_order wait_oldest: oldest version first, then FIFO order
    assert fresh and c2[0][1][0].to_dict() == fresh[0].to_dict()  # the checkpointed FIFO is served first
    trained = [(x.epoch, x.index) for _, b in c1 + c2 for x in b]
    assert len(trained) == len(set(trained)) == 32
    assert sorted(trained + pending_refs(final)) == sorted(issued_refs(final))
    assert max(e for e, _ in trained) == 1


def test_metrics_match_a_recount_of_the_consumed_samples():
    async def run():
        c = FakeClient(token_time=0.002, p_stop=0.1)
        s = make(c, eta=2, concurrency=10, max_new_tokens=30)
        await s.start()
        await train_loop(s, c, 3)
        s.metrics()  # reset the per-batch window
        v = s.version
        batch = await s.next_batch()
        m = s.metrics()
        await s.stop()
        return v, batch, m
    v, batch, m = asyncio.run(run())
    lags = [v - min(x.action_versions) for x in batch]
    assert m["rollout/staleness_mean"] == pytest.approx(sum(lags) / len(lags))
    assert m["rollout/staleness_max"] == max(lags)
    for lag in set(lags):
        assert m[f"rollout/staleness_hist/{lag}"] == lags.count(lag)
    toks = [v - t for x in batch for t in x.action_versions]
    for lag in set(toks):
        assert m[f"rollout/token_frac_lag/{lag}"] == pytest.approx(toks.count(lag) / len(toks))
    assert m["rollout/reward_mean/phase_0"] == pytest.approx(sum(x.reward for x in batch) / len(batch))
    assert 0.0 < m["rollout/engine_util_mean"] <= 1.0
    for key in ("rollout/interrupted", "rollout/resumed", "rollout/dropped_stale", "rollout/fifo_samples",
                "rollout/in_flight", "rollout/requeue_depth"):
        assert key in m


def _sample(rng: random.Random, index: int) -> Sample:
    p, t = rng.randint(1, 6), rng.randint(1, 9)
    mask = [rng.randint(0, 1) for _ in range(t)]
    mask[0] = 1
    return Sample(prompt_ids=[rng.randint(3, 100) for _ in range(p)],
                  response_ids=[rng.randint(3, 100) for _ in range(t)], action_mask=mask,
                  rollout_logprobs=[-rng.random() if m else 0.0 for m in mask],
                  versions=[rng.randint(0, 3) if m else -1 for m in mask], reward=rng.random(),
                  turn_rewards=[0.5], turn_spans=[[0, 1]], index=index)


def test_collate_aligns_trajectory_position_t_with_prompt_len_plus_t():
    rng = random.Random(0)
    samples = [_sample(rng, i) for i in range(7)]
    out = collate(samples, pad_id=0, pad_to_multiple=4)
    assert out["tokens"].shape[1] % 4 == 0
    for b, s in enumerate(samples):  # slow reference, element by element
        p = len(s.prompt_ids)
        assert out["prompt_lens"][b] == p and out["seq_lens"][b] == p + len(s.response_ids)
        for i in range(out["tokens"].shape[1]):
            t = i - p
            inside = 0 <= t < len(s.response_ids)
            assert out["tokens"][b, i] == ((s.prompt_ids + s.response_ids)[i] if i < p + len(s.response_ids) else 0)
            assert out["action_mask"][b, i] == (s.action_mask[t] if inside else 0)
            assert out["versions"][b, i] == (s.versions[t] if inside else -1)
            assert out["rollout_logprobs"][b, i] == pytest.approx(s.rollout_logprobs[t] if inside else 0.0)
            assert out["token_rewards"][b, i] == pytest.approx(s.token_rewards()[t] if inside else 0.0)
        assert out["rewards"][b] == pytest.approx(s.reward)


def test_token_rewards_and_serialisation():
    s = Sample(prompt_ids=[1, 9], response_ids=[10, 11, 5, 12, 6, 13, 2], action_mask=[1, 1, 0, 0, 0, 1, 1],
               rollout_logprobs=[-1, -2, 0, 0, 0, -3, -4], versions=[0, 0, -1, -1, -1, 1, 1], reward=2.0,
               turn_rewards=[0.25, 0.5], turn_spans=[[0, 2], [5, 7]])
    assert s.token_rewards() == [0, 0.25, 0, 0, 0, 0, 2.5]
    assert s.oldest_version() == 0 and s.staleness(2) == 2
    import numpy as np
    s.routed_experts = np.arange(24, dtype=np.int32).reshape(8, 1, 3)
    back = Sample.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back.to_dict() == s.to_dict() and back.routed_experts.shape == (8, 1, 3)
    for ids in (np.array([[0, 255]]), np.array([[3, 256]]), np.array([[7, 70000]]), np.array([[-1, 5]])):
        s.routed_experts = ids.astype(np.int32)
        back = Sample.from_dict(json.loads(json.dumps(s.to_dict())))
        assert back.routed_experts.dtype == np.int32 and np.array_equal(back.routed_experts, ids), ids
    old = {**s.to_dict(), "routed_experts": {"shape": [2, 2], "data": [1, 2, 3, 4]}}  # the former JSON form
    assert Sample.from_dict(old).routed_experts.tolist() == [[1, 2], [3, 4]]
    wide = np.random.default_rng(0).integers(0, 256, size=(8192, 75, 8)).astype(np.int32)  # GLM-5: 8k tokens
    s.routed_experts = wide
    assert len(json.dumps(s.to_dict())) < wide.size * 1.4  # base64 of uint8, not JSON numbers
    with pytest.raises(ValueError, match="disagree"):
        Sample(prompt_ids=[1], response_ids=[1, 2], action_mask=[1], rollout_logprobs=[0.0], versions=[0])


def test_reward_phases_switch_target_at_the_given_version():
    from sao_megatron.config.schema import DataConfig, RewardPhase, RolloutConfig

    task = ArithmeticTask(num_prompts=64, options={"min_operand": 10, "max_operand": 40})
    answers = {tuple(p.input_ids): p.meta["answer"] for p in task.prompts()}
    data = DataConfig(phases=[RewardPhase(start_version=2, target="reverse")], reward_workers=1)

    async def run():
        c = FakeClient(script=lambda ids: TOK.encode(answers[tuple(ids)]) + [TOK.eos_id])  # always the plain answer
        s = AsyncScheduler.from_config(c, task, SchedulerConfig(mode="single", batch_size=4, concurrency=4, max_staleness=0),
                                       data, RolloutConfig(max_new_tokens=8))
        await s.start()
        out = []
        for v in range(4):
            batch = await asyncio.wait_for(s.next_batch(), 60)  # generous: a bug must fail, not hang the suite
            out.append((v, batch, s.metrics()))

            async def push(v=v + 1):
                c.version = v
            await asyncio.wait_for(s.on_weights_updated(v + 1, push), 60)
        await s.stop()
        return out
    for v, batch, m in asyncio.run(run()):
        phase = 0 if v < 2 else 1
        assert all(x.phase == phase for x in batch)
        for x in batch:
            ans = answers[tuple(x.prompt_ids)]
            assert (x.reward == 1.0) == (phase == 0 or ans == ans[::-1])  # "reverse" wants the digits backwards
        assert m[f"rollout/reward_mean/phase_{phase}"] == pytest.approx(sum(x.reward for x in batch) / 4)
        assert f"rollout/reward_mean/phase_{1 - phase}" not in m


def test_engines_behind_the_trainer_version_fail_loudly():
    async def run():
        c = FakeClient()
        s = make(c, eta=0)
        await s.start()
        await s.next_batch()
        await s.on_weights_updated(1)  # "pushed" nothing: the engine still generates version 0
        with pytest.raises(RuntimeError, match="do not serve the trainer's weights"):
            await asyncio.wait_for(s.next_batch(), 10)
        await s.stop()
    asyncio.run(run())


def test_a_failed_pause_does_not_close_admission_for_good():
    """Every engine died between the trainer's health check and the pause of a weight push: the
    push fails, but generation and admission go on once engines are back (the gate reopens)."""
    class PauseFails(FakeClient):
        fail_next_pause = False

        async def pause_generation(self, mode="retract"):
            if self.fail_next_pause:
                self.fail_next_pause = False
                raise EngineUnavailable("every engine is down", url="fake://0")
            await super().pause_generation(mode)

    async def run():
        c = PauseFails()
        s = make(c, eta=1, concurrency=2)  # the second batch needs admissions after the failure
        await s.start()
        await s.next_batch()
        c.fail_next_pause = True
        with pytest.raises(EngineUnavailable):
            await s.on_weights_updated(1)
        assert s.version == 0  # the weights were not pushed
        # generation goes on under the old weights: the second batch of the admission budget arrives
        assert len(await asyncio.wait_for(s.next_batch(), 20)) == 4

        async def push():
            c.version = 1
        await s.on_weights_updated(1, push)  # the engines are back: the next push goes through
        assert len(await asyncio.wait_for(s.next_batch(), 20)) == 4
        await s.stop()
    asyncio.run(run())


def test_a_failed_update_is_not_hidden_by_a_failed_continue():
    """The weight load fails (say, a malformed checkpoint) and continue_generation fails too: the
    error raised is the load's, which says what to fix, and admission still reopens."""
    class ContinueFails(FakeClient):
        async def continue_generation(self):
            await super().continue_generation()
            raise EngineUnavailable("every engine failed", url="fake://0")

    async def run():
        c = ContinueFails()
        s = make(c, eta=1)
        await s.start()
        await s.next_batch()

        async def push():
            raise ValueError("malformed checkpoint: model.layers.0.mlp.gate.weight missing")
        with pytest.raises(ValueError, match="malformed checkpoint"):
            await s.on_weights_updated(1, push)
        assert s.version == 0 and s._gate.is_set()
        await s.stop()
    asyncio.run(run())


@pytest.mark.parametrize("engines_left", [0, 1])
def test_engines_that_all_die_during_a_push_leave_the_weights_recorded(tmp_path, engines_left):
    """WeightPublisher's pause: the last engines die during the push (pause fails with EngineUnavailable
    and none is healthy): like engines already down before it, the push records the weights for
    readmission and returns, so the next batch waits for an engine and ends in NoEngineError rather
    than a raw EngineUnavailable. With an engine still healthy the error is a real one and is raised."""

    from sao_megatron.config import ExperimentConfig
    from sao_megatron.config.schema import DataConfig, RolloutConfig
    from sao_megatron.weights.readmission import CurrentWeights
    from sao_megatron.weights.publisher import WeightPublisher
    from sao_megatron.training.run.rollout_side import RolloutSide

    class DiesOnPause(FakeClient):
        async def pause_generation(self, mode="retract"):
            if not engines_left:
                self.engine_urls = []  # the client marked every engine unhealthy
            raise EngineUnavailable("/pause_generation: every engine failed", url="fake://0")

    side = RolloutSide(rollout=RolloutConfig(), scheduler=SchedulerConfig(), data=DataConfig(), task=None,
                       mode="single", group_size=1, run_dir=tmp_path, template_dir=tmp_path)
    pub = WeightPublisher(ExperimentConfig(), None, tmp_path, rank0=True)
    try:
        side.client = DiesOnPause()
        pub.served = CurrentWeights(tmp_path / "weights" / "v000000", 0)
        side.scheduler = make(side.client)
        side.scheduler._served = pub.served  # the one record of the version, as WeightPublisher.start wires it
        pub.rollout = side
        loaded = []

        class Written:  # a staged disk push of v3 (weights.staged.Staged)
            version, path, reached = 3, tmp_path / "weights" / "v000003", None

            async def deliver(self):
                loaded.append(True)
        if engines_left:
            with pytest.raises(EngineUnavailable):
                side.bridge.run(pub._deliver_paused(Written()))
            assert pub.served.version == 0 and side.scheduler.version == 0
        else:
            side.bridge.run(pub._deliver_paused(Written()))
            assert pub.served.version == 3 and side.scheduler.version == 3
            assert pub.served.path == tmp_path / "weights" / "v000003"
        assert not loaded  # no engine loaded anything
    finally:
        side.bridge.close()


def test_engine_utilisation_counts_requests_still_open_in_every_window_they_span(monkeypatch):
    """A request sent before a window and still open after it kept its engine busy for the whole
    window; one that finishes in the next window counts there only for its overlap. Against a
    recount by hand on a controlled clock."""
    from sao_megatron.scheduler import stats as stats_mod

    clock = [100.0]
    monkeypatch.setattr(stats_mod.time, "monotonic", lambda: clock[0])
    st = stats_mod.RolloutStats()
    st._window_start = 100.0  # the dataclass default read the real clock
    urls = ["http://a", "http://b"]
    engines = {"r1": "http://a", "r2": "http://b"}
    st.request_opened("r1", 101.0)  # open through the first window
    st.request_opened("r2", 104.0)
    clock[0] = 105.0
    st.request_closed("r2")
    st.observe_request("http://b", 104.0, 105.0)
    clock[0] = 110.0
    first = st.report(urls, engine_of=engines.get)
    assert first["rollout/engine_util/0"] == pytest.approx(9 / 10)  # r1: 101..110 still open
    assert first["rollout/engine_util/1"] == pytest.approx(1 / 10)
    clock[0] = 112.0
    st.request_closed("r1")
    st.observe_request("http://a", 101.0, 112.0)
    clock[0] = 120.0
    second = st.report(urls, engine_of=engines.get)
    assert second["rollout/engine_util/0"] == pytest.approx(2 / 10)  # only its overlap 110..112
    assert second["rollout/engine_util/1"] == 0.0
    assert second["rollout/engine_util_mean"] == pytest.approx(0.1)
    # without a way to attribute open requests (a router), there is no utilisation, not a false 0
    st.request_opened("r3", 121.0)
    clock[0] = 125.0
    assert not any(k.startswith("rollout/engine_util") for k in st.report([], engine_of=None))
