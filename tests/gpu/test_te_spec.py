"""GPU only: the Transformer Engine spec path, grouped-GEMM experts included, against the local spec.

Runs tests/component/mp_scripts/te_vs_local.py (tiny MoE: TE model saved, loaded into the local
model). gpu_check.sh requires TE on a GPU (SAO_GPU_CHECK_REQUIRE_TE=1): then a node without TE
FAILS here instead of skipping; with --no-te it does not run this file at all (and says so).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
from megatron_launch import run_json

pytestmark = [pytest.mark.gpu, pytest.mark.component]


@pytest.fixture(scope="module")
def te_vs_local(tmp_path_factory):
    if importlib.util.find_spec("transformer_engine") is None:
        if os.environ.get("SAO_GPU_CHECK_REQUIRE_TE") == "1":
            pytest.fail("Transformer Engine is required (gpu_check.sh default on a GPU) but not installed")
        pytest.skip("Transformer Engine is not installed (gpu_check.sh --no-te leaves this file out)")
    return run_json("te_vs_local.py", tmp_path_factory.mktemp("te_vs_local"), timeout=600)


def test_te_spec_with_grouped_experts_matches_the_local_spec(te_vs_local):
    print(f"\nGPU_CHECK_NUMBERS test_te_spec_with_grouped_experts_matches_the_local_spec: TE modules "
          f"{', '.join(te_vs_local['te_modules'])}; max |Δlogp| TE vs local {te_vs_local['logprob_maxdiff']:.1e}")
    assert "TEGroupedMLP" in te_vs_local["te_modules"], te_vs_local["te_modules"]  # grouped experts ran
    assert te_vs_local["te_keys"] == te_vs_local["local_keys"]
    assert te_vs_local["logprob_maxdiff"] < 1e-3  # TE kernels vs torch ops in fp32
