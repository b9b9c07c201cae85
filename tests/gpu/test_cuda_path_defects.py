"""CUDA-path defects found in review, checked without a GPU (issue 25).

- Resuming on a CUDA node without TE/apex: megatron falls back to torch's AdamW, whose ``step``
  state the distributed optimizer cannot reload (KeyError 'step'). The shim used to come only
  with the CPU shims; it must apply whenever fused Adam is absent, on CUDA too.
- DSA models on a GPU without TE: the indexer's ``LocalLinear`` projections were created on the
  CPU whatever the init device ("the device" is ``meta`` here: a CPU tensor shows the bug).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.unit
META = torch.device("meta")


@pytest.fixture
def recorded_step_state(monkeypatch):
    """Megatron's DistributedOptimizer state setter replaced by a recorder (restored after the test):
    the list of state dicts it receives, as the shim (if applied) passes them on."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from sao_megatron.parallel import cpu_support

    seen: list[dict] = []
    monkeypatch.setattr(DistributedOptimizer, "_set_main_param_and_optimizer_states",
                        lambda self, param, tensors: seen.append(tensors))
    # The shim also wraps load_state_dict (per-parameter `step` copies): undone after the test too.
    monkeypatch.setattr(DistributedOptimizer, "load_state_dict", DistributedOptimizer.load_state_dict)
    monkeypatch.setattr(cpu_support, "_SKIPPED", set(), raising=False)
    return DistributedOptimizer, seen


def _setup_optimizer_on_cuda(monkeypatch, *, fused_adam: bool) -> None:
    """setup_optimizer on a "CUDA node" (no CPU shims) with megatron's DDP/optimizer construction
    stubbed out (no process groups needed)."""
    from megatron.core.optimizer import distrib_optimizer

    from sao_megatron.training.step import optim

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", fused_adam)
    config = SimpleNamespace(params_dtype=torch.bfloat16, fp16=False)
    monkeypatch.setattr(optim, "get_model_config", lambda chunk: config)
    monkeypatch.setattr(optim, "wrap_ddp", lambda chunks, ctx: list(chunks))
    monkeypatch.setattr(optim, "get_megatron_optimizer", lambda cfg, chunks: SimpleNamespace())
    monkeypatch.setattr(optim, "megatron_optimizer_config", lambda *a, **k: None)
    monkeypatch.setattr(optim, "build_scheduler", lambda *a, **k: None)
    ctx = SimpleNamespace(parallel=SimpleNamespace(use_distributed_optimizer=True))
    optim.setup_optimizer([torch.nn.Linear(2, 2)], None, ctx, total_steps=1)


def test_adamw_step_shim_applies_on_cuda_without_fused_adam(recorded_step_state, monkeypatch):
    """Failed before: on CUDA the shim was never applied, megatron got no `step` key to skip."""
    cls, seen = recorded_step_state
    _setup_optimizer_on_cuda(monkeypatch, fused_adam=False)
    cls._set_main_param_and_optimizer_states(None, "param", {"exp_avg": torch.zeros(1)})
    assert seen[-1]["step"] is None and "exp_avg" in seen[-1]
    _setup_optimizer_on_cuda(monkeypatch, fused_adam=False)  # a second optimizer: not wrapped twice
    cls._set_main_param_and_optimizer_states(None, "param", {"exp_avg": torch.zeros(1)})
    assert len(seen) == 2


def test_adamw_step_shim_stays_off_with_fused_adam(recorded_step_state, monkeypatch):
    """TE/apex fused Adam keeps `step` in its param groups: megatron's own path is left alone."""
    cls, seen = recorded_step_state
    _setup_optimizer_on_cuda(monkeypatch, fused_adam=True)
    cls._set_main_param_and_optimizer_states(None, "param", {"exp_avg": torch.zeros(1)})
    assert "step" not in seen[-1]


def test_dsa_indexer_local_linear_is_created_on_the_init_device(monkeypatch):
    """Failed before: LocalLinear ignored the init device, its weight stayed on the CPU."""
    from sao_megatron.models import specs

    monkeypatch.setattr(specs, "init_device", lambda config: META)
    config = SimpleNamespace(params_dtype=torch.bfloat16)
    layer = specs.LocalLinear(8, 4, config=config, init_method=None)
    assert {p.device for p in layer.parameters()} == {META}
    assert layer.weight.dtype == torch.bfloat16
