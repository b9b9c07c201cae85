"""GPU only: TP2 and EP2 with two ranks sharing one GPU over gloo, against TP1 (see the script)."""

from __future__ import annotations

import json
import pathlib

import pytest
from megatron_launch import run

pytestmark = [pytest.mark.gpu, pytest.mark.component]

SCRIPT = pathlib.Path(__file__).resolve().parent / "mp_scripts" / "gloo_cuda_layouts.py"


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gloo_cuda")
    run(str(SCRIPT), str(tmp / "results.json"), str(tmp), nproc=2, timeout=400)
    return {r["layout"]: r for r in json.loads((tmp / "results.json").read_text())}


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_forward_backward_matches_tp1_with_cuda_tensors_over_gloo(rows, layout):
    row = rows[layout]
    print(f"\nGPU_CHECK_NUMBERS test_forward_backward_matches_tp1_with_cuda_tensors_over_gloo[{layout}]: "
          + row["detail"])
    if row["status"] == "SKIP":
        pytest.skip(row["detail"])  # gloo lacks a collective for CUDA tensors: a fact about gloo, said as such
    assert row["status"] == "PASS", row["detail"]
    assert row["params_on"] == ["cuda:0"] and row["backend"] == "gloo"
