"""Which collective backend rollout.weight_sync.transport=distributed sends with (weights/disk.py)."""

from __future__ import annotations

import pytest
import torch

from sao_megatron.config.schema import RolloutConfig, WeightSyncConfig
from sao_megatron.weights.transports import build_weight_sync

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("engine", "cuda", "backend"), [
    ("embedded", False, "gloo"), ("embedded", True, "gloo"),
    # CPU Slurm nodes: embedded servers behind rollout.engine=sglang (the launcher's override) need gloo
    ("sglang", False, "gloo"), ("sglang", True, "nccl"),
])
def test_backend_follows_the_trainers_device(monkeypatch, engine, cuda, backend):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    rollout = RolloutConfig(engine=engine, weight_sync=WeightSyncConfig(transport="distributed"))
    sync = build_weight_sync(rollout, client=None, run_dir="/r", template_dir=None)
    try:
        assert sync.backend == backend
    finally:
        sync.close()
