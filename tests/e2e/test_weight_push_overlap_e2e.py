"""rollout.weight_sync.overlap in the real trainer (Megatron on gloo, embedded engines over HTTP): a run
ends with the engines serving its final version (asked from the engines), and the audit's staleness,
counted from the step index (the actor's version when every update applies), stays within the limit."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from test_train_e2e import CONFIG, REPO, SMALL, audit_unique, metrics_by_step

SCRIPT = REPO / "tests" / "e2e" / "mp_scripts" / "final_version.py"

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # a whole run each, 40-90 s on 2 busy cores


@pytest.mark.parametrize("overlap, sync, eta", [(False, "disk", 1), (True, "disk", 1), (True, "distributed", 1),
                                                (True, "disk", 0)])
def test_a_run_ends_with_the_engines_serving_its_final_version(tmp_path, overlap, sync, eta):
    out = tmp_path / "final.json"
    sets = [*SMALL, "run.num_steps=5", "checkpoint.save_interval=0", f"scheduler.max_staleness={eta}",
            f"rollout.weight_sync.overlap={str(overlap).lower()}", f"rollout.weight_sync.transport={sync}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--standalone", str(SCRIPT),
           str(CONFIG), str(out), *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    r = json.loads(out.read_text())
    assert r["step"] == r["version"] == 5 and r["engine_versions"] == ["5", "5"], r
    run_dir = pathlib.Path(r["run_dir"])
    metrics = metrics_by_step(run_dir)
    assert all(m["actor/update_applied"] == 1.0 for m in metrics)  # so the actor trains step k at version k
    rl = [a for a in audit_unique(run_dir) if a["phase"] == "rl"]
    assert len(rl) == 5 * 8
    for a in rl:
        assert a["version"] == a["step"] and 0 <= a["step"] - a["oldest_version"] <= eta, a
