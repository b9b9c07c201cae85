"""The CPU shims leak without cpu_shims_scope, and the scope puts the process back as it was.

Megatron used to run inside the pytest process with a bare ``init_distributed``: CudaToCpuMode and
the torch.cuda patches stayed active for every later test (an HF forward ran 1.65x slower under it).
"""

from __future__ import annotations

import sys

import pytest
import torch

from sao_megatron.config import ParallelConfig
from sao_megatron.parallel.bootstrap import destroy, init_distributed
from sao_megatron.parallel.cpu_support import cpu_shims_scope, shims_applied

pytestmark = pytest.mark.component


def _callables() -> dict[tuple[str, str], object]:
    """Every function/class reachable as a module or class attribute in torch and megatron (identity)."""
    out = {}
    for mname, mod in list(sys.modules.items()):
        if mod is None or not mname.startswith(("torch", "megatron")):
            continue
        for name, value in list(vars(mod).items()):
            if callable(value):
                out[(mname, name)] = value
            if isinstance(value, type) and value.__module__ == mname:
                out.update(((f"{mname}.{name}", k), v) for k, v in vars(value).items() if callable(v))
    return out


WARM_IMPORTS = ("megatron.core.parallel_state", "megatron.core.tensor_parallel", "megatron.core.optimizer",
                "megatron.core.distributed", "megatron.core.models.gpt", "megatron.core.transformer.moe.token_dispatcher",
                "megatron.core.transformer.experimental_attention_variant.dsa", "torch.optim")


def test_scope_restores_every_attribute_any_shim_touched():
    """Generic, so a new shim whose target is missing from cpu_support._patched_objects fails here."""
    import importlib

    for name in WARM_IMPORTS:  # a patch is seen only on a module imported before the scope
        importlib.import_module(name)
    before = _callables()
    with cpu_shims_scope(force=True):
        init_distributed(ParallelConfig(), seed=1, device="cpu", environ={})
        destroy()
        patched = {k for k, v in _callables().items() if k in before and v is not before[k]}
    after = _callables()
    assert {("torch.cuda", "current_device"), ("torch.cuda", "Stream")} <= patched  # the comparison sees patches
    assert [k for k in before if after.get(k) is not before[k]] == []


def test_destroy_leaves_the_device_mode_active_and_the_scope_ends_it():
    current_device = torch.cuda.current_device
    with cpu_shims_scope(force=True):
        init_distributed(ParallelConfig(), seed=1, device="cpu", environ={})
        destroy()
        # The leak: Megatron is torn down, yet "cuda" still means the CPU and torch.cuda is patched.
        assert torch.empty(1, device="cuda").device.type == "cpu"
        assert torch.cuda.current_device is not current_device and shims_applied()
    assert torch._C._len_torch_function_stack() == 0 and not shims_applied()
    assert torch.cuda.current_device is current_device
    if torch.cuda.is_available():
        assert torch.empty(1, device="cuda").device.type == "cuda"
    else:
        with pytest.raises(RuntimeError):  # no GPU: a real "cuda" placement fails again
            torch.empty(1, device="cuda")
