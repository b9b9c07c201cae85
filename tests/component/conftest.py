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

    with cpu_shims_scope():  # a no-op with a GPU, where init_distributed picks CUDA and needs no shims
        ctx = init_distributed(ParallelConfig(), seed=1, environ={})
        try:
            yield ctx
        finally:
            destroy()


# ---------------------------------------------------------------- embedded engines, shared
# Session fixtures live here, not in rollout_fixtures: one imported into several modules would be
# built once per module. Modules that import tiny_dirs themselves keep their own copy.
from rollout_fixtures import API_KEY, reset_weights, revived, tiny_dirs  # noqa: E402, F401 - tiny_dirs: fixture


@pytest.fixture(scope="session")
def engine_processes(tiny_dirs, tmp_path_factory):  # noqa: F811
    """Two embedded engines on the base weights (API key, routed experts, 20 s update timeout), started
    once for test_rollout_http and test_weight_sync_distributed; tests take them through ``engines``."""
    from sao_megatron.rollout.launch import LocalEngines

    with LocalEngines(tiny_dirs["base"], 2, api_key=API_KEY, log_dir=tmp_path_factory.mktemp("engine-logs"),
                      extra_args=["--enable-return-routed-experts", "--max-running-requests", "8",
                                  "--weight-update-timeout-s", "20"]) as eng:
        yield eng


@pytest.fixture
def engines(engine_processes, tiny_dirs):  # noqa: F811
    """The shared engines, each alive (a failure test killed one: see ``revived``) and on the base
    weights at version 0, whatever an earlier test pushed: no test depends on another's leftovers."""
    reset_weights(revived(engine_processes), tiny_dirs["base"])
    return engine_processes
