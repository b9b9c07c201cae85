"""One episode: alternate generation turns on the engines with environment steps.

Generation of a turn survives weight updates according to ``partial_rollout``:

- ``retract``: the engine keeps the request and continues it under the new weights; the reply's
  per-token versions show where the weights changed (nothing to do here);
- ``abort``: the engine returns the partial output (finish_reason abort); the turn is resubmitted
  as context + partial tokens once generation resumes, keeping the log-probs and versions of the
  tokens already generated. The same path recovers from an engine that dies mid-request (its
  partial output is lost; the turn continues from the last completed segment on a healthy engine);
- ``discard``: an aborted generation ends the episode (``EpisodeDiscarded``); the scheduler
  re-queues the prompt.

Routed experts (routing replay): each reply's rows are merged into the sample's, the first reply
covering a position fixing its route (``scheduler.routes``). SGLang's retract re-prefills the
interrupted request and returns the re-prefill's routes for its earlier tokens, so with routed
experts on, ``retract`` pauses the engines with ``abort`` and resubmits (``pause_mode``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from sao_megatron.envs.base import Prompt, Task
from sao_megatron.rollout.types import EngineReplyError, EngineTimeout, EngineUnavailable, SamplingParams
from sao_megatron.scheduler.prompts import PromptRef
from sao_megatron.scheduler.routes import merge_routes
from sao_megatron.scheduler.sample import Sample
from sao_megatron.scheduler.stats import RolloutStats

logger = logging.getLogger(__name__)


class EpisodeDiscarded(Exception):
    """The generation was aborted by a weight update under partial_rollout=discard."""


class EpisodeFailed(Exception):
    """The engines kept failing for this episode (or rejected the request)."""


@dataclass(slots=True, eq=False)
class Episode:
    """Book-keeping of one running episode."""

    uid: int
    ref: PromptRef
    prompt: Prompt
    group_id: int
    admitted_version: int = 0
    """Trainer version when the episode started: the engines already served it."""
    generating: bool = False
    """A /generate request of this episode is open right now."""
    interrupted: bool = False
    """A weight update paused the currently open request."""
    num_interruptions: int = 0
    num_requests: int = 0
    rid: str | None = None
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class _Turn:
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    routed: np.ndarray | None


class EpisodeRunner:
    """Runs episodes of ``task`` against ``client``; ``gate`` is closed while weights are updated."""

    def __init__(self, client, task: Task, sampling: SamplingParams, *, max_turns: int, max_total_tokens: int,
                 partial_rollout: str, gate: asyncio.Event, stats: RolloutStats,
                 return_routed_experts: bool = False, max_engine_retries: int = 5,
                 retry_backoff_s: float = 0.5, env_threads: int = 8) -> None:
        if max_turns < 1 or max_total_tokens < 1:
            raise ValueError("data.max_turns and data.max_total_tokens must be >= 1")
        self.client, self.task = client, task
        self.sampling = dataclasses.replace(
            sampling, stop_token_ids=sorted(set(sampling.stop_token_ids) | set(task.stop_token_ids)))
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        self.partial_rollout = partial_rollout
        self.gate, self.stats = gate, stats
        self.return_routed_experts = return_routed_experts
        self.max_engine_retries, self.retry_backoff_s = max_engine_retries, retry_backoff_s
        self._env_pool = concurrent.futures.ThreadPoolExecutor(env_threads, thread_name_prefix="env")
        self._aborts: set[asyncio.Future] = set()

    @property
    def pause_mode(self) -> str:
        """How the engines are paused for a weight update: ``retract`` keeps requests on the engine,
        except when routes are collected (a retracted request's earlier routes are recomputed)."""
        return "retract" if self.partial_rollout == "retract" and not self.return_routed_experts else "abort"

    async def drain_aborts(self, timeout_s: float = 5.0) -> None:
        """Wait for the engine aborts of cancelled requests to go out."""
        if self._aborts:
            await asyncio.wait(set(self._aborts), timeout=timeout_s)

    def close(self) -> None:
        self._env_pool.shutdown(wait=False, cancel_futures=True)

    async def rollout(self, ep: Episode) -> Sample:
        """Generate the whole trajectory (reward fields left for the scheduler)."""
        env = self.task.make_env()
        ep.timings.update(start=time.time(), generate=0.0, env=0.0)
        prompt_ids = env.reset(ep.prompt)
        s = Sample(prompt_ids=prompt_ids, response_ids=[], action_mask=[], rollout_logprobs=[], versions=[],
                   index=ep.ref.index, epoch=ep.ref.epoch, group_id=ep.group_id, attempt=ep.ref.attempt)
        for turn in range(self.max_turns):
            budget = min(self.sampling.max_new_tokens, self.max_total_tokens - len(prompt_ids) - len(s.response_ids))
            if budget <= 0:
                s.finish_reason = "max_total_tokens"
                break
            t = await self._turn(ep, prompt_ids + s.response_ids, budget, s.routed_experts)
            s.turn_spans.append([len(s.response_ids), len(s.response_ids) + len(t.ids)])
            _append(s, t.ids, 1, t.logprobs, t.versions)
            s.finish_reason, s.routed_experts = t.finish_reason, t.routed
            step = await self._env_step(ep, env, t)
            s.turn_rewards.append(float(step.reward))
            if step.done:
                break
            if turn == self.max_turns - 1:
                s.finish_reason = "max_turns"
                break
            room = self.max_total_tokens - len(prompt_ids) - len(s.response_ids)
            obs = list(step.observation_ids[:max(room, 0)])
            _append(s, obs, 0, [0.0] * len(obs), [-1] * len(obs))
            if len(obs) < len(step.observation_ids):
                s.finish_reason = "max_total_tokens"
                break
        s.num_interruptions = ep.num_interruptions
        return s

    async def _env_step(self, ep: Episode, env, t: _Turn):
        t0 = time.monotonic()
        step = await asyncio.get_running_loop().run_in_executor(
            self._env_pool, functools.partial(env.step, t.ids, finish_reason=t.finish_reason))
        ep.timings["env"] += time.monotonic() - t0
        return step

    async def _turn(self, ep: Episode, context: list[int], budget: int, routes: np.ndarray | None) -> _Turn:
        out = _Turn([], [], [], "length", routes)
        failures = 0
        failed_on: set[str] = set()  # engines that failed this turn: its resubmissions go elsewhere if they can
        while len(out.ids) < budget:
            await self.gate.wait()  # never submit while the weights are being replaced
            sampling = dataclasses.replace(self.sampling, max_new_tokens=budget - len(out.ids))
            try:
                res = await self._generate(ep, context + out.ids, sampling, avoid=frozenset(failed_on))
            except (EngineUnavailable, EngineTimeout) as exc:
                failures += 1
                if exc.url is not None:
                    failed_on.add(exc.url)
                await self._recover(ep, exc, failures)
                continue
            now = time.monotonic()
            self.stats.observe_request(res.engine_url, now - res.latency_s, now)
            ep.timings["generate"] += res.latency_s
            out.ids += res.output_ids
            out.logprobs += res.logprobs
            out.versions += res.versions
            out.routed = merge_routes(out.routed, res.routed_experts)  # never overwritten by a re-prefill
            out.finish_reason = res.finish_reason
            if res.finish_reason != "abort":
                if ep.interrupted:  # retract: the request went on under the new weights
                    self.stats.add("resumed")
                return out
            if self.partial_rollout == "discard":
                raise EpisodeDiscarded(f"episode {ep.uid} aborted by a weight update")
            self.stats.add("resumed")
        out.finish_reason = "length"
        return out

    async def _generate(self, ep: Episode, input_ids: list[int], sampling: SamplingParams, avoid: frozenset[str]):
        ep.num_requests += 1
        ep.rid = f"{ep.uid:016x}{ep.num_requests:016x}"
        ep.generating, ep.interrupted = True, False
        self.stats.request_opened(ep.rid, time.monotonic())
        try:
            return await self.client.generate(input_ids, sampling, rid=ep.rid, avoid=avoid,
                                              return_routed_experts=self.return_routed_experts)
        except EngineReplyError as exc:
            if exc.status_code is not None and exc.status_code >= 500:
                raise EngineUnavailable(str(exc), url=exc.url) from exc
            raise EpisodeFailed(f"engine rejected episode {ep.uid}: {exc}") from exc
        except asyncio.CancelledError:
            task = asyncio.ensure_future(self._abort_quietly(ep.rid))  # free the engine's slot
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
            raise
        finally:
            ep.generating = False
            self.stats.request_closed(ep.rid)

    async def _recover(self, ep: Episode, exc: Exception, failures: int) -> None:
        self.stats.add("engine_retries")
        if failures > self.max_engine_retries:
            raise EpisodeFailed(f"episode {ep.uid}: engines failed {failures} times, last: {exc}") from exc
        logger.warning("episode %d: %s; resubmitting, to another healthy engine if there is one (try %d)",
                       ep.uid, exc, failures)
        await asyncio.sleep(self.retry_backoff_s * 2 ** (failures - 1))
        try:
            await self.client.health()
        except Exception:  # noqa: BLE001 - health probing is best effort
            logger.debug("health probe failed", exc_info=True)

    async def _abort_quietly(self, rid: str) -> None:
        try:
            await self.client.abort_request(rid)
        except Exception:  # noqa: BLE001 - best effort: the request may be finished already
            pass


def _append(s: Sample, ids: list[int], mask: int, logprobs: list[float], versions: list[int]) -> None:
    s.response_ids += ids
    s.action_mask += [mask] * len(ids)
    s.rollout_logprobs += logprobs
    s.versions += versions
