"""GPU only (skipped without CUDA): TE-spec and local-spec models share one checkpoint format.

A checkpoint written on a CPU machine (local spec) must load into the GPU model (TE spec) and back;
the local spec keeps its sharded keys TE-compatible (see models/specs.py). Where Transformer Engine
is not installed (a GPU node without the NGC image) these tests skip and say so: the local spec runs
there instead, checked by tests/gpu/.
"""

from __future__ import annotations

import importlib.util

import pytest
from megatron_launch import run_json

pytestmark = [pytest.mark.component, pytest.mark.gpu]


@pytest.fixture(scope="module")
def te_vs_local(tmp_path_factory):
    if importlib.util.find_spec("transformer_engine") is None:
        pytest.skip("Transformer Engine is not installed here: the local spec runs on this GPU (tests/gpu/)")
    return run_json("te_vs_local.py", tmp_path_factory.mktemp("te_vs_local"), timeout=600)


def test_te_spec_is_used_on_gpu(te_vs_local):
    assert te_vs_local["te_modules"], "no Transformer Engine modules in the GPU model"


def test_checkpoint_keys_match_between_te_and_local_specs(te_vs_local):
    assert te_vs_local["te_keys"] == te_vs_local["local_keys"]


def test_te_checkpoint_loads_into_local_model_with_same_logprobs(te_vs_local):
    assert te_vs_local["logprob_maxdiff"] < 1e-3  # TE kernels vs torch ops in fp32
