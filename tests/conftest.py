"""Shared pytest fixtures, the gpu auto-skip (the only skip allowed) and the global-state leak check."""

from __future__ import annotations

import pytest
import torch

# torch.cuda's functions and classes as torch defined them: the CPU shims replace some; none may stay replaced.
_CUDA_BASELINE = {(mod.__name__, name): value for mod in (torch.cuda, torch.cuda.random)
                  for name, value in vars(mod).items() if callable(value) and not name.startswith("__")}


def torch_leaks() -> list[str]:
    """What a test left behind in torch's global state: active modes, patched torch.cuda attributes."""
    import sys

    found = []
    if torch._C._len_torch_function_stack():
        found.append(f"torch function modes still active: {torch.overrides._get_current_function_mode_stack()}")
    if torch._C._len_torch_dispatch_stack():
        found.append(f"{torch._C._len_torch_dispatch_stack()} torch dispatch mode(s) still active")
    if getattr(torch.cuda, "_sao_cpu_shim", False):
        found.append("torch.cuda still marked as patched by sao_megatron's CPU shims")
    changed = sorted(f"{m}.{n}" for (m, n), v in _CUDA_BASELINE.items() if vars(sys.modules[m]).get(n) is not v)
    if changed:
        found.append(f"torch.cuda attributes replaced: {', '.join(changed)}")
    return found


@pytest.fixture(scope="module", autouse=True)
def _no_torch_leaks():
    """Fails the module (at its last teardown) that leaves torch modes or patches active.

    Megatron in the pytest process belongs under tests/component/conftest.py's megatron_ctx.
    """
    yield
    leaks = torch_leaks()
    if leaks:
        pytest.fail("this module leaks global torch state into later tests: " + "; ".join(leaks)
                    + " (run Megatron under the megatron_ctx fixture or in a subprocess)", pytrace=False)


def pytest_sessionfinish(session, exitstatus):
    """Session-end check: anything still active now (a session fixture, a plugin) fails the run."""
    leaks = torch_leaks()
    if leaks:
        session.config.get_terminal_writer().line("torch state leaked: " + "; ".join(leaks), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_addoption(parser):
    parser.addoption("--reverse-order", action="store_true",
                     help="run the selected tests in reverse order (CI: proves no test depends on an earlier one)")


@pytest.hookimpl(trylast=True)  # after pytest's own grouping of tests by shared fixtures
def pytest_collection_modifyitems(config, items):
    if config.getoption("--reverse-order"):
        items.reverse()
    _skip_gpu_tests(items)


def _skip_gpu_tests(items):
    try:
        has_gpu = torch.cuda.is_available()
    except Exception:  # pragma: no cover - a broken CUDA setup means no GPU either
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        # The marker, not item.keywords: keywords also hold folder names, and tests/gpu/ has CPU tests.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
