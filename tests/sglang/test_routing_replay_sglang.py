"""R3 on real SGLang: `sao-megatron train` with rollout.engine=sglang and rollout.routing_replay=true.

The trainer starts one real SGLang server with --enable-return-routed-experts; the engine's routes
come back with every episode, the Megatron actor replays them, and every step logs
``rollout/route_mismatch_frac`` (the metric exists only when routes were replayed and compared).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # the e2e run helpers, reused
from test_train_e2e import audit_unique, metrics_by_step, run_train  # noqa: E402

pytestmark = pytest.mark.sglang


def test_training_on_real_sglang_replays_routes_and_logs_the_mismatch(sglang_python, tmp_path):
    run_dir = tmp_path / "run"
    run_train(run_dir, "rollout.engine=sglang", f"rollout.sglang_python={sglang_python}", "rollout.num_engines=1",
              "rollout.routing_replay=true", "run.num_steps=2", "run.sft_steps=1")
    assert "'enable_return_routed_experts': True" in _server_args(run_dir)
    steps = metrics_by_step(run_dir)
    assert len(steps) == 2 and all(0.0 <= m["rollout/route_mismatch_frac"] <= 1.0 for m in steps)
    # Step 0: samples of version 0, trainer at version 0, the engine's routes replayed: the trainer's
    # own router agrees (ties aside) and the importance ratio is 1 up to fp32 summation order (the
    # parity test measures 4.8e-7 between the Megatron actor and real SGLang on this model).
    assert steps[0]["rollout/route_mismatch_frac"] < 0.01
    assert abs(steps[0]["actor/ratio_min"] - 1.0) < 1e-4 and abs(steps[0]["actor/ratio_max"] - 1.0) < 1e-4
    audit_unique(run_dir)


def _server_args(run_dir: Path) -> str:
    """What the trainer started the server with (SGLang logs its server_args at start-up)."""
    return "\n".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("engine*.log"))
