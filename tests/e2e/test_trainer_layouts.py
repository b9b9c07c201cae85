"""The trainer's update is layout-independent: TP2 (sequence parallel) and EP2 under torchrun on
gloo give the TP1 loss for the same weights and batch."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "component"))  # the one megatron_launch (its server) of the session
from megatron_launch import launch  # noqa: E402

SCRIPT = REPO / "tests" / "e2e" / "mp_scripts" / "update_parity.py"
CONFIG = REPO / "configs" / "experiments" / "tiny_cpu.yaml"

pytestmark = pytest.mark.e2e


def torchrun(nproc: int, ckpt, out, *args: str, config: pathlib.Path = CONFIG, timeout: int = 600) -> dict:
    """``torchrun --standalone --nproc_per_node=NPROC update_parity.py ...`` as megatron_launch starts it."""
    proc = launch([SCRIPT, config, ckpt, out, *args], nproc=nproc, cwd=REPO, timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return json.loads(pathlib.Path(out).read_text())


@pytest.mark.slow  # over 60 s on 2 cores (66-107 s measured): runs in CI's slow stage
def test_first_step_loss_equal_at_tp2_and_ep2(tmp_path):
    ckpt = tmp_path / "ckpt"
    ref = torchrun(1, ckpt, tmp_path / "tp1.json", "--save")
    tp2 = torchrun(2, ckpt, tmp_path / "tp2.json", "--set", "parallel.tensor_model_parallel_size=2",
                   "--set", "parallel.sequence_parallel=true")
    ep2 = torchrun(2, ckpt, tmp_path / "ep2.json", "--set", "parallel.expert_model_parallel_size=2")
    assert ref["actor/loss"] != 0.0 and ref["critic/loss"] > 0.0
    for other in (tp2, ep2):
        for key in ("actor/loss", "critic/loss", "actor/grad_norm", "advantages/mean", "actor/entropy"):
            assert other[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key


@pytest.fixture(scope="module")
def nan_guard(tmp_path_factory) -> dict:
    """mp_scripts/nan_guard.py's findings: one good update, then non-finite ones (one process)."""
    out = tmp_path_factory.mktemp("nan") / "nan.json"
    proc = launch([REPO / "tests" / "e2e" / "mp_scripts" / "nan_guard.py", CONFIG, out], cwd=REPO, timeout=600,
                  check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_non_finite_loss_is_skipped_then_stops(nan_guard):
    r = nan_guard
    assert r["good_applied"] and r["changed_by_good"]
    assert not r["bad_applied"] and r["unchanged_by_bad"]
    assert "consecutive" in r["stopped"] and "run.max_nan_steps" in r["stopped"]


def test_after_actor_runs_between_the_actor_and_the_critic_steps(nan_guard):
    """Where an overlapped weight push starts: the actor's weights are final, the critic has not stepped."""
    r = nan_guard
    assert r["hook_calls_good"] == 1 and r["actor_final_at_hook"] and r["critic_untouched_at_hook"]
    assert r["critic_changed_after"]
    assert r["hook_calls_bad"] == 0  # a skipped update makes no new version to push


@pytest.mark.parametrize("override, message", [
    ("data.path=/nonexistent/prompts.jsonl", "/nonexistent/prompts.jsonl"),
    ("data.max_prompt_tokens=2", "max_prompt_tokens"),
])
def test_bad_data_fails_before_training_with_one_line(tmp_path, override, message):
    run_dir = tmp_path / "bad"
    proc = launch(["sao_megatron.cli", "train", "--config", CONFIG, "--run-dir", run_dir, "--set", override],
                  module=True, cwd=REPO, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("sao-megatron train: error:") and message in last
    assert not (run_dir / "metrics.jsonl").exists()


def test_empty_dataset_is_refused(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = launch(["sao_megatron.cli", "train", "--config", CONFIG, "--run-dir", tmp_path / "run", "--set",
                   f"data.path={empty}"], module=True, cwd=REPO, timeout=300, check=False)
    assert proc.returncode == 2 and "empty" in proc.stderr.strip().splitlines()[-1].lower()


def test_grpo_clip_bites_only_with_several_steps_per_batch(tmp_path):
    """Issue 16: with one optimizer step per batch GRPO's old log-probs equal the current ones
    (ratio 1, no clip: plain REINFORCE); PPO-style epochs x mini-batches make the clip real."""
    out = tmp_path / "ppo.json"
    proc = launch([REPO / "tests" / "e2e" / "mp_scripts" / "ppo_epochs.py", CONFIG, out], cwd=REPO, timeout=600,
                  check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    single, epochs = result["single"], result["epochs"]
    assert single["applied"] and epochs["applied"]
    assert single["clip_frac"] == 0.0 and single["lr_steps"] == 1
    assert epochs["clip_frac"] > 0.0 and epochs["lr_steps"] == 4  # 2 epochs x 2 mini-batches
