"""Shared pytest fixtures and the gpu auto-skip (the only skip allowed)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing means no GPU either
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        # The marker, not item.keywords: keywords also hold folder names, and tests/gpu/ has CPU tests.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
