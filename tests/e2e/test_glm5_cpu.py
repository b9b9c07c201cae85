"""The tiny CPU job on a GLM-5-shaped model (MLA + DeepSeek sparse attention): SAO steps and the parity gate.

configs/experiments/tiny_glm5_cpu.yaml: the real trainer (Megatron actor + critic on gloo) and
one embedded engine serving transformers' GlmMoeDsaForCausalLM, prompts + answers longer than
the indexer's top-k (8). The critic's frozen attention (MLA projections, latent norms, DSA
indexer) and embeddings/norms must come out of RL steps bit-identical, its experts and value
head changed; the actor's trainable weights change too. The log-prob gate compares the
engine's log-probs with the Megatron actor's on the generated tokens.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "experiments" / "tiny_glm5_cpu.yaml"
# 30 supervised warm-up steps: from a random init every reward (and so every value target) is 0 and
# neither critic nor actor would receive a gradient to show what is frozen.
SMALL = ["run.num_steps=4", "run.sft_steps=30", "scheduler.batch_size=8",
         "scheduler.concurrency=16", "critic.pretrain_steps=1", "checkpoint.save_interval=2",
         "logging.log_interval=1", "data.num_prompts=400"]

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # minutes on 2 cores each


def run_cli(*args: str, timeout: int = 900) -> None:
    proc = subprocess.run([sys.executable, "-m", "sao_megatron.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def model_tensors(ckpt_dir: pathlib.Path, tmp: pathlib.Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a torch_dist checkpoint directory (optimizer state left out)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ckpt_dir.parent.name}-{ckpt_dir.name}.pt"
    dcp_to_torch_save(ckpt_dir, out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and "optimizer" not in k
            and not k.endswith("_extra_state")}


def test_sao_steps_keep_the_critics_frozen_mla_and_indexer(tmp_path):
    run_dir = tmp_path / "run"
    sets = [a for o in SMALL for a in ("--set", o)]
    run_cli("train", "--config", str(CONFIG), "--run-dir", str(run_dir), "--resume", "auto", *sets)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert sorted({m["step"] for m in metrics}) == [0, 1, 2, 3]
    assert all(m["actor/update_applied"] == 1.0 for m in metrics)
    assert any(m["critic/loss"] > 0 for m in metrics if m["step"] >= 2)  # the critic had something to learn
    ckpts = run_dir / "checkpoints"
    before = {role: model_tensors(ckpts / "step_00000002" / role, tmp_path) for role in ("critic", "actor")}
    after = {role: model_tensors(ckpts / "step_00000004" / role, tmp_path) for role in ("critic", "actor")}
    critic_b, critic_a = before["critic"], after["critic"]
    assert set(critic_b) == set(critic_a)
    # The critic's default trainables: routed and shared experts, value head (output_layer).
    trained = {k for k in critic_b if "experts." in k or k.startswith("output_layer.")}
    frozen = set(critic_b) - trained
    assert any(".core_attention.indexer." in k for k in frozen) and any("linear_kv_down_proj" in k for k in frozen)
    assert len(trained) >= 4
    assert {k for k in critic_b if not torch.equal(critic_b[k], critic_a[k])} == trained
    actor_changed = [k for k in before["actor"] if ".experts." in k
                     and not torch.equal(before["actor"][k], after["actor"][k])]
    assert actor_changed


def test_logprob_parity_gate_on_tiny_glm5(tmp_path):
    run_cli("parity", "--config", str(CONFIG), "--run-dir", str(tmp_path), "--num-prompts", "8",
            "--max-new-tokens", "32", "--tol", "1e-5")
    report = json.loads((tmp_path / "parity.json").read_text())
    assert report["parity/num_tokens"] == 8 * 32  # every prompt ran past the indexer's top-k
    assert report["parity/max_abs"] <= 1e-5, report
