"""The scheduler's partial rollouts across weight updates on a real SGLang server, in every
``scheduler.partial_rollout`` mode, accounted exactly once.

The embedded-engine version (tests/component/test_scheduler_engine.py) drives the same loop and
audits; its helpers are reused here: batches are consumed while three different checkpoints are
pushed from disk as versions 1, 2, 3..., each push landing while SGLang generates. Per mode:
- every admitted episode ends in exactly one consumed sample or one recorded drop (stale, discarded,
  failed), or is still in flight / queued: nothing lost, nothing trained twice;
- each token's version is the one whose weights sampled it (its log-prob equals a fresh HF forward
  of that version's checkpoint), versions never go back within a sample;
- at least one episode crossed an update: retract and abort resume it (samples carrying two
  versions), discard drops it and re-queues its prompt.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from conftest import API_KEY, build_tiny_moe

from sao_megatron.scheduler.stats import COUNTERS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "component"))  # the embedded version's helpers
from test_scheduler_engine import (  # noqa: E402
    NUM_CHECKPOINTS, audit_logprobs, audit_staleness_and_counts, run_training)

pytestmark = pytest.mark.sglang
# SGLang on CPU in float32 against transformers' forward: summation-order noise (measured < 1e-5 idle);
# a token attributed to the wrong version is off by ~1 with these peaked random weights.
LOGPROB_TOL = 1e-3


@pytest.fixture(scope="module")
def ckpts(tiny_moe, tmp_path_factory) -> list[str]:
    """Version v serves ckpts[v % 3]; ckpts[0] is the session server's own model (restored at the end)."""
    root = tmp_path_factory.mktemp("partial-ckpts")
    assert NUM_CHECKPOINTS == 3
    import torch

    return [str(tiny_moe("fp32"))] + [str(build_tiny_moe(root / f"v{seed}", dtype=torch.float32, seed=seed))
                                      for seed in (1, 2)]


def sglang_generates(server, timeout_s: float = 60.0):
    """The wait before each push: until SGLang, in a load snapshot taken after the wait began, holds a
    request in its running batch. SGLang has no per-request token counts (the embedded engine's
    ``num_output_tokens``); its ``/v1/loads`` snapshot is republished at every prefill, and a request in
    the running batch has been prefilled: it holds its first output token and has more to generate."""
    async def wait(sched, client) -> None:
        began = time.time()
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(trust_env=False, timeout=30, headers=server.headers) as http:
            while sched._in_flight and time.monotonic() < deadline:
                load = (await http.get(server.url + "/v1/loads")).json()["loads"][0]
                if load["timestamp"] > began and load["num_running_reqs"] > 0:
                    return
                await asyncio.sleep(0.02)  # each poll costs the server's HTTP process CPU on a 2-core box
    return wait


@pytest.mark.parametrize("partial,eta", [("retract", 1), ("abort", 2), ("discard", 1)])
def test_partial_rollouts_across_weight_updates_exactly_once(sglang_server, ckpts, partial, eta):
    engines = SimpleNamespace(urls=[sglang_server.url])
    try:
        consumed, state, metrics = asyncio.run(run_training(
            engines, ckpts, steps=3, eta=eta, partial=partial, wait=sglang_generates(sglang_server), api_key=API_KEY))
    finally:  # the session server serves its own weights at version 0 again
        httpx.post(sglang_server.url + "/update_weights_from_disk", headers=sglang_server.headers, timeout=120,
                   json={"model_path": ckpts[0], "weight_version": "0"}, trust_env=False)
    audit_staleness_and_counts(consumed, state, eta)
    c = {k: int(metrics[f"rollout/{k}"]) for k in (*COUNTERS, "in_flight", "fifo_samples")}
    assert c["failed"] == 0
    assert c["admitted"] == (c["trained"] + c["dropped_stale"] + c["discarded"] + c["in_flight"]
                             + c["fifo_samples"]), c
    samples = [s for _, b in consumed for s in b]
    for s in samples:
        assert len(s.versions) == len(s.response_ids) == len(s.rollout_logprobs)
        assert s.action_versions == sorted(s.action_versions), "a version went back within a sample"
    audit_logprobs(ckpts, samples, tol=LOGPROB_TOL)
    mixed = [s for s in samples if len(set(s.action_versions)) > 1]
    if partial == "discard":
        assert not mixed and c["discarded"] >= 1, c  # the interrupted episodes were dropped and re-queued
    else:
        assert mixed, "no partial rollout crossed a weight update"
        assert c["interrupted"] >= len(mixed) and c["resumed"] >= 1, c
