"""``model.dsa_indexer_loss_coeff``: megatron's own sparse KL loss trains the DSA indexer of the
actor (DeepSeek-V3.2's recipe); the critic's stays frozen. Before the option the coefficient was
hard-wired off and every indexer parameter frozen (0 trainable, 0 with a gradient)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.component
SCRIPT = pathlib.Path(__file__).resolve().parent / "mp_scripts" / "dsa_indexer_loss.py"


def test_indexer_kl_loss_gives_the_actors_indexer_gradients(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), "0.1"], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res == {"indexer": 5, "trainable": 5, "with_grad": 5, "critic_trainable_indexer": 0}
