"""Fixtures for component tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def megatron_ctx():
    """One Megatron rank (gloo, world 1) inside the pytest process, for one module only.

    The CPU shims patch torch.cuda and enter CudaToCpuMode; ``cpu_shims_scope`` undoes both when
    the module ends, so no later test runs under them (tests/conftest.py checks that).
    """
    from sao_megatron.config import ParallelConfig
    from sao_megatron.parallel.bootstrap import destroy, init_distributed
    from sao_megatron.parallel.cpu_support import cpu_shims_scope

    with cpu_shims_scope(force=True):
        ctx = init_distributed(ParallelConfig(), seed=1, environ={})
        try:
            yield ctx
        finally:
            destroy()
