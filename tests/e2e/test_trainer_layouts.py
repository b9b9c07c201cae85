"""The trainer's update is layout-independent: TP2 (sequence parallel) and EP2 under torchrun on
gloo give the TP1 loss for the same weights and batch."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "e2e" / "mp_scripts" / "update_parity.py"
CONFIG = REPO / "configs" / "experiments" / "tiny_cpu.yaml"

pytestmark = pytest.mark.e2e


def torchrun(nproc: int, ckpt, out, *args: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
           str(SCRIPT), str(CONFIG), str(ckpt), str(out), *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    return json.loads(pathlib.Path(out).read_text())


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
