"""Exporter and loader on Transformer Engine grouped experts at EP>1 / expert-TP>1 (module doubles).

TE needs CUDA; ``mp_scripts/te_grouped_doubles.py`` reproduces the attributes TE 2.20.0.dev0 and
Megatron-core 0.19.2 set on TEGroupedMLP's GroupedLinear modules (its docstring names the source)
and runs the real loader and exporter on them with 4 gloo ranks (one launch for every scenario).
The local-spec path (SequentialMLP) is covered with real Megatron models in test_convert.py.
"""

from __future__ import annotations

import pytest
from megatron_launch import run_json

pytestmark = pytest.mark.component

SCENARIOS = ["ep2", "etp2", "ep2_etp2", "etp2_te_attrs_only", "single_weight_ep2_etp2", "single_weight_etp2"]
CHECKS = ["load_matches_reference", "export_all_matches_hf", "export_rank0_matches_hf"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_json("te_grouped_doubles.py", tmp_path_factory.mktemp("te_grouped"), nproc=4, timeout=600)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_grouped_experts_load_and_export(report, scenario):
    result = report[scenario]
    assert "error" not in result, result.get("trace")
    assert {c: result[c] for c in CHECKS} == dict.fromkeys(CHECKS, True)
