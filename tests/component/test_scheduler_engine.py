"""The scheduler against real embedded engines over HTTP (tiny random Qwen3-MoE, real sampling).

A stream of weight updates (three different HF checkpoints, versions cycling through them) runs
while episodes are in flight. Audits: every consumed sample within the staleness bound (all
per-token versions), no prompt lost or trained twice, partial rollouts carrying several versions
whose log-probs match a fresh HF forward of the checkpoint of each token's version, group mode,
η = 0, multi-turn masks/boundaries, and an engine killed mid-run.
"""

from __future__ import annotations

import asyncio

import pytest
from rollout_fixtures import build_tiny_moe, hf_model, revived

from sao_megatron.config.schema import SchedulerConfig
from sao_megatron.envs import ArithmeticTask, CharTokenizer, Env, StepResult
from sao_megatron.rollout.client import RolloutClient
from sao_megatron.rollout.launch import LocalEngines
from sao_megatron.rollout.parity import hf_logprobs
from sao_megatron.rollout.types import SamplingParams
from sao_megatron.scheduler import AsyncScheduler, PromptCursor

pytestmark = pytest.mark.component
TOK = CharTokenizer()
NUM_CHECKPOINTS = 3
SAMPLING = SamplingParams(max_new_tokens=24, temperature=1.0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> list[str]:
    """Three random checkpoints; version v is served from ckpts[v % 3]. Vocabulary 128 covers the
    char tokenizer (103 ids) whose eos (2) is the model's eos."""
    root = tmp_path_factory.mktemp("sched-moe")
    dirs = []
    for seed in range(NUM_CHECKPOINTS):
        d = build_tiny_moe(root / f"v{seed}", seed=seed, eos_token_id=TOK.eos_id, bos_token_id=TOK.bos_id)
        TOK.save_hf_tokenizer(d)
        dirs.append(str(d))
    return dirs


@pytest.fixture(scope="module")
def engine_processes(ckpts, tmp_path_factory):
    with LocalEngines(ckpts[0], 2, log_dir=tmp_path_factory.mktemp("sched-engine-logs"),
                      extra_args=["--max-running-requests", "8"]) as eng:
        yield eng


@pytest.fixture
def engines(engine_processes):
    """Every engine alive: the test that kills one does not have to run last."""
    return revived(engine_processes)


async def run_training(engines, ckpts, *, steps, mode="single", eta=1, partial="retract", group_size=1,
                       batch_size=4, concurrency=8, task=None, max_turns=1, on_start=None, wait=None, api_key=None):
    """Consume ``steps`` batches; after each, push checkpoint (v+1) % 3 as version v+1 once ``wait(sched,
    client)`` returns (default :func:`let_generation_run`; tests/sglang passes real SGLang's own signal)."""
    client = RolloutClient(engines.urls, timeout_s=120, api_key=api_key)
    await client.update_weights_from_disk(ckpts[0], weight_version=0)  # every test starts at v0
    cfg = SchedulerConfig(mode=mode, batch_size=batch_size, concurrency=concurrency, max_staleness=eta,
                          partial_rollout=partial)
    sched = AsyncScheduler(client, task or ArithmeticTask(num_prompts=200, seed=3), cfg, SAMPLING,
                           group_size=group_size, max_turns=max_turns, reward_workers=1, retry_backoff_s=0.05)
    consumed = []
    try:
        await sched.start()
        side = asyncio.create_task(on_start(client)) if on_start else None
        for step in range(steps):
            batch = await sched.next_batch()
            consumed.append((sched.version, batch))
            await (wait or let_generation_run)(sched, client)  # the trainer's step: the engines keep generating
            v = sched.version + 1

            async def push(v=v):
                await client.begin_weight_update()
                await client.update_weights_from_disk(ckpts[v % NUM_CHECKPOINTS], weight_version=v)
                await client.end_weight_update()
            await sched.on_weights_updated(v, push)
        state, metrics = sched.state_dict(), sched.metrics()
        if side:
            await side
    finally:
        await sched.stop()
        await client.aclose()
    return consumed, state, metrics


async def let_generation_run(sched, client, timeout_s=5.0):
    """Until an engine holds a request with output tokens (if any may run), so the weight update that
    follows lands in the middle of a generation: a fixed sleep let the pause land, now and then, when
    every open request was still queued or just finished, and no rollout crossed the update."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while sched._in_flight and loop.time() < deadline:
        states = [s for info in await client.server_info() for s in info.get("internal_states", [])]
        if any(n > 0 for s in states for n in s.get("num_output_tokens", {}).values()):
            return
        await asyncio.sleep(0.005)


def audit_staleness_and_counts(consumed, state, eta):
    trained = []
    for v, batch in consumed:
        for s in batch:
            vs = s.action_versions
            assert vs and v - eta <= min(vs) and max(vs) <= v, f"sample versions {vs} at trainer version {v}"
            assert all(x == -1 for x, m in zip(s.versions, s.action_mask) if not m)
            trained.append((s.epoch, s.index))
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    c = state["cursor"]
    order = PromptCursor(c["num_prompts"], seed=c["seed"], shuffle=c["shuffle"])._epoch_order(c["epoch"])
    issued = [(c["epoch"], i) for i in order[:c["position"]]]
    pending = ([(e, i) for e, i, _ in c["requeued"]]
               + [(d["epoch"], d["index"]) for unit in state["fifo"] for d in unit[:1]])
    assert sorted(set(trained) | set(pending)) == sorted(issued) and len(pending) == len(set(pending)), \
        "a prompt was lost (neither trained, queued, in flight nor re-queued)"
    return trained


def audit_logprobs(ckpts, samples, tol=2e-4):
    """Each action token's log-prob equals a fresh HF forward of the checkpoint of its version."""
    for s in samples:
        ref = {v: hf_logprobs(hf_model(ckpts[v % NUM_CHECKPOINTS]), s.prompt_ids, s.response_ids, SAMPLING)
               for v in set(s.action_versions)}
        for t, (v, m) in enumerate(zip(s.versions, s.action_mask)):
            if m:
                assert abs(s.rollout_logprobs[t] - ref[v][t]) < tol, (t, v, s.rollout_logprobs[t], ref[v][t])


@pytest.mark.parametrize("partial,eta", [("retract", 1), ("abort", 2)])
def test_weight_update_stream_staleness_exactly_once_and_mixed_version_logprobs(engines, ckpts, partial, eta):
    consumed, state, metrics = asyncio.run(run_training(engines, ckpts, steps=5, eta=eta, partial=partial))
    audit_staleness_and_counts(consumed, state, eta)
    samples = [s for _, b in consumed for s in b]
    mixed = [s for s in samples if len(set(s.action_versions)) > 1]
    assert mixed, "no partial rollout crossed a weight update"
    assert metrics["rollout/interrupted"] >= len(mixed) and metrics["rollout/resumed"] >= 1
    audit_logprobs(ckpts, samples)


def test_eta_zero_never_trains_on_an_older_token(engines, ckpts):
    consumed, state, metrics = asyncio.run(run_training(engines, ckpts, steps=3, eta=0, concurrency=16))
    for v, batch in consumed:
        assert all(set(s.action_versions) == {v} for s in batch)
    audit_staleness_and_counts(consumed, state, 0)
    assert metrics["rollout/dropped_stale"] == 0


def test_group_mode_releases_only_complete_groups(engines, ckpts):
    consumed, state, _ = asyncio.run(run_training(engines, ckpts, steps=2, mode="group", group_size=4,
                                                  batch_size=8, concurrency=8))
    for _, batch in consumed:
        groups = {}
        for s in batch:
            groups.setdefault(s.group_id, []).append((s.epoch, s.index))
        assert len(groups) == 2 and all(len(g) == 4 and len(set(g)) == 1 for g in groups.values())
    audit_logprobs(ckpts, [s for _, b in consumed for s in b])


class _TurnEnv(Env):
    """Answers every turn with ``<obs>tN</obs>`` (never done: the turn budget ends the episode)."""

    def __init__(self):
        self.turn = 0

    def reset(self, prompt):
        return list(prompt.input_ids)

    def step(self, action_ids, *, finish_reason):
        self.turn += 1
        return StepResult(observation_ids=[TOK.obs_id] + TOK.encode(f"t{self.turn}") + [TOK.obs_end_id],
                          done=False, reward=0.5)


class _MultiTurnTask(ArithmeticTask):
    def make_env(self):
        return _TurnEnv()


def test_multi_turn_observations_masked_and_turn_boundaries_right(engines, ckpts):
    consumed, state, _ = asyncio.run(run_training(engines, ckpts, steps=2, task=_MultiTurnTask(num_prompts=50),
                                                  max_turns=3))
    audit_staleness_and_counts(consumed, state, 1)
    samples = [s for _, b in consumed for s in b]
    for s in samples:
        assert len(s.turn_spans) == 3 and s.finish_reason == "max_turns"
        pos = 0
        for turn, (start, end) in enumerate(s.turn_spans):
            assert start == pos and end > start
            assert s.action_mask[start:end] == [1] * (end - start)
            pos = end
            if turn < 2:
                obs = [TOK.obs_id] + TOK.encode(f"t{turn + 1}") + [TOK.obs_end_id]
                assert s.response_ids[pos:pos + len(obs)] == obs
                assert s.action_mask[pos:pos + len(obs)] == [0] * len(obs)
                assert s.rollout_logprobs[pos:pos + len(obs)] == [0.0] * len(obs)
                pos += len(obs)
        assert pos == len(s.response_ids)
        rewards = s.token_rewards()
        assert [rewards[e - 1] for _, e in s.turn_spans] == pytest.approx([0.5, 0.5, 0.5 + s.reward])
    # later turns were generated from prompt + earlier turns + observations: their log-probs match
    audit_logprobs(ckpts, samples)


def test_engine_killed_mid_run_episodes_resume_on_the_healthy_engine(engines, ckpts):
    """Kills engine 1 while it has requests open (the next test gets it back)."""
    victim = engines.urls[1]

    async def kill_when_busy(client):
        while client._router.inflight[victim] < 2:
            await asyncio.sleep(0.005)
        await asyncio.to_thread(engines.kill, 1)

    consumed, state, metrics = asyncio.run(run_training(engines, ckpts, steps=3, eta=2, on_start=kill_when_busy))
    audit_staleness_and_counts(consumed, state, 2)
    assert metrics["rollout/engine_retries"] >= 2
    assert metrics["rollout/failed"] == 0
    audit_logprobs(ckpts, [s for _, b in consumed for s in b])
