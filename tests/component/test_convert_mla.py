"""HF <-> Megatron conversion of tiny random DeepSeek-V3 and GLM-5 (MLA + DeepSeek sparse attention) models.

The reference is transformers itself (``DeepseekV3ForCausalLM`` / ``GlmMoeDsaForCausalLM``, fp32,
eager) on sequences longer than the indexer's top-k. One plain-python launch converts every
shape and runs the mutations (mla_roundtrip.py, ``slow``: minutes on 2 cores); one torchrun launch
covers TP2xEP2 and PP2 (mla_layouts.py, ``slow``). The default run converts one GLM-5 shape (quick).
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from tests.component.test_convert import assert_bit_exact, run

pytestmark = pytest.mark.component

SCRIPTS = pathlib.Path(__file__).resolve().parent / "convert_scripts"
sys.path.insert(0, str(SCRIPTS))
from mla_fixtures import SHAPES  # noqa: E402

TOL = 1e-4
DSA_SHAPES = [n for n, s in SHAPES.items() if "index_topk" in s]


def test_quick_glm5_round_trip_parity_and_mtp(tmp_path):
    """Default-suite smoke: sparse (top-8 of 32 keys) GLM-5 with shared-indexer layers and an MTP layer."""
    run([SCRIPTS / "mla_roundtrip.py", tmp_path, tmp_path / "r.json", "--quick"], timeout=600)
    r = json.loads((tmp_path / "r.json").read_text())["shapes"]["glm5_shared_idx_mtp"]
    assert r["max_abs_diff"] <= TOL and r["max_abs_logit"] > 0.5, r
    assert_bit_exact(tmp_path / "glm5_shared_idx_mtp" / "hf", tmp_path / "glm5_shared_idx_mtp" / "hf_out")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    work = tmp_path_factory.mktemp("convert_mla")
    run([SCRIPTS / "mla_roundtrip.py", work, work / "report.json"], timeout=900)
    return work, json.loads((work / "report.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SHAPES))
def test_fp32_logits_parity_with_transformers(converted, name):
    r = converted[1]["shapes"][name]
    assert r["max_abs_diff"] <= TOL and r["max_abs_logit"] > 0.5, r


@pytest.mark.slow
@pytest.mark.parametrize("name", DSA_SHAPES)
def test_parity_covers_the_sparse_path(converted, name):
    """transformers' own logits change when the top-k covers every key: the 32-token check is sparse."""
    assert converted[1]["shapes"][name]["sparse_effect"] > 100 * TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SHAPES))
def test_hf_to_megatron_to_hf_is_bit_exact_including_mtp_layers(converted, name):
    base = converted[0] / name
    assert_bit_exact(base / "hf", base / "hf_out")
    index = json.loads((base / "hf_out" / "model.safetensors.index.json").read_text())["weight_map"]
    num_layers = SHAPES[name]["num_hidden_layers"]
    mtp = [k for k in index if k.startswith(f"model.layers.{num_layers}.")]
    assert bool(mtp) == bool(SHAPES[name]["num_nextn_predict_layers"]), mtp


@pytest.mark.slow
@pytest.mark.parametrize("mutation", ["dsv3_no_yarn", "dsv3_no_groups", "glm5_k_norm_swapped"])
def test_dropping_an_architecture_detail_breaks_parity(converted, mutation):
    assert converted[1]["mutations"][mutation] > 100 * TOL


@pytest.mark.slow
def test_hadamard_rotation_keeps_parity_and_cpu_needs_its_shim(converted):
    report = converted[1]
    assert report["mutations"]["glm5_rotation_off"] <= TOL  # rotated or not: same top-k, same logits
    assert "bf16" in report["unshimmed_rotate_error"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dsv3_yarn_groups_mtp", "glm5_shared_idx_mtp"])
def test_tp2ep2_and_pp2_loads_equal_tp1(converted, name):
    work, _ = converted
    key = "layouts"
    if key not in converted[1]:
        run([SCRIPTS / "mla_layouts.py", work, work / "layouts.json", "--shapes",
             "dsv3_yarn_groups_mtp,glm5_shared_idx_mtp"], timeout=1500, nproc=4)
        converted[1][key] = json.loads((work / "layouts.json").read_text())
    r = converted[1][key][name]
    assert r["tp2ep2"] <= TOL and r["pp2"] <= TOL and r["import_tp2ep2_then_pp2"] <= TOL, r
    assert_bit_exact(work / name / "hf", work / name / "hf_tp2ep2")
