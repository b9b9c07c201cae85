"""rollout.weight_sync.transport=distributed from the real trainer (Megatron on gloo, torchrun) into two embedded
engines: every owner sends its own slice, the engines' checksums match the export, their log-probs
equal the actor's (the parity gate) and their version advances."""

from __future__ import annotations

import json
import pathlib

import pytest

from sao_megatron.config import load_config
from test_train_e2e import metrics_by_step, run_train  # also puts tests/component on sys.path

from megatron_launch import launch  # noqa: I001 - after test_train_e2e, which makes it importable

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "e2e" / "mp_scripts" / "weight_sync_trainer.py"
CONFIG = REPO / "configs" / "experiments" / "tiny_cpu.yaml"

pytestmark = pytest.mark.e2e


def sync_run(tmp_path, nproc: int, *overrides: str, external: bool = False) -> dict:
    out = tmp_path / f"sync{nproc}.json"
    sets = [a for o in overrides for a in ("--set", o)] + (["--external"] if external else [])
    # What torchrun --standalone --nproc_per_node=NPROC starts (OMP_NUM_THREADS=1), forked from the session's
    # preloaded server: no launcher process, no torch + Megatron imports per rank.
    proc = launch([SCRIPT, CONFIG, out, *sets], nproc=nproc, cwd=REPO, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def check(r: dict, num_senders: int, unchecked: int = 0) -> None:
    """``unchecked``: exported tensors the first push's checksums cannot cover (parts of fused parameters
    that live on different ranks)."""
    assert r["version"] == 2 and r["engine_versions"] == ["2", "2"]
    assert r["client_version"] == 2 and r["healthy_after"] == 2, r  # health() keeps engines serving v2
    first, second = r["first"], r["second"]
    assert first["weight_sync/verified"] == 1 and second["weight_sync/verified"] == 0
    assert first["weight_sync/unverified_tensors"] == unchecked, first
    assert first["weight_sync/failed_engines"] == 0 and first["weight_sync/num_senders"] == num_senders
    assert first["weight_sync/bytes"] == second["weight_sync/bytes"] == 2 * first["weight_sync/engine_bytes"] > 0
    assert all(n >= 4 for n in r["parity_tokens"]) and max(r["parity_max_abs"]) < 1e-4, r


def test_tp1_trainer_to_two_engines(tmp_path):
    check(sync_run(tmp_path, 1), num_senders=1)


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["distributed", "disk"])
def test_engines_reached_by_url_keep_serving_across_pushes(tmp_path, sync):
    """rollout.engine=sglang (servers reached by URL, started from their own weights): every push of
    either transport advances the version the client expects, so the health probe an episode retry
    makes keeps the engines that took it (before the publisher, a distributed push left the client
    expecting version 0 and health() took every engine out)."""
    r = sync_run(tmp_path, 1, f"rollout.weight_sync.transport={sync}", external=True)
    assert r["version"] == r["client_version"] == 2 and r["engine_versions"] == ["2", "2"], r
    assert r["healthy_after"] == 2, r
    assert r["first"]["weight_sync/verified"] == 1, r["first"]


@pytest.mark.slow
def test_bf16_weights_verify_against_the_engines_holding(tmp_path):
    """bf16 parameters: the engine holds them in its own dtype (the embedded engine: float32) and its
    checksums are of that; the sync compares like with like and verifies (before: 45 tensors differed
    and the first push stopped with WeightMismatchError)."""
    r = sync_run(tmp_path, 1, "model.params_dtype=bf16")
    assert r["first"]["weight_sync/verified"] == 1 and r["first"]["weight_sync/unverified_engines"] == 0, r
    assert r["healthy_after"] == 2, r


@pytest.mark.slow
def test_tp2_trainer_to_two_engines(tmp_path):
    # TP shards are gathered inside the TP group; rank 0 sends them, rank 1 owns nothing whole
    r = sync_run(tmp_path, 2, "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true")
    check(r, num_senders=1)


@pytest.mark.slow
def test_tp2_ep2_trainer_four_ranks(tmp_path):
    # EP2: the second EP rank sends its experts (global ids) over its own groups
    r = sync_run(tmp_path, 4, "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                 "parallel.expert_model_parallel_size=2")
    # experts.w13_weight / w2_weight hold every expert and each EP rank exports half: every expert's
    # gate, up and down of every MoE layer cannot be checked, and the metric counts exactly those
    model = load_config(CONFIG).model
    check(r, num_senders=2, unchecked=model.num_layers * model.num_moe_experts * 3)


@pytest.mark.slow
def test_main_job_with_distributed_sync(tmp_path):
    run_dir = tmp_path / "run"
    run_train(run_dir, "rollout.weight_sync.transport=distributed")
    metrics = metrics_by_step(run_dir)
    assert [m["version"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["rollout/staleness_max"] <= 1 for m in metrics)
    # Overlapped (the default), each row carries its own step's push, the last one's too.
    assert all(m["rollout/weight_sync_bytes"] > 0 and m["weight_sync/num_senders"] == 1 for m in metrics)
