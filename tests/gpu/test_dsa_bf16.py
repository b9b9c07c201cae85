"""The dsa-bf16 check of gpu_check.sh (issue 37): a tiny GLM-5 (MLA + DSA) in bf16, forward and
backward against the same weights in fp32. On a GPU the check runs it on CUDA; here the same script
runs on the CPU (what ``gpu_check.sh --cpu`` runs too), and its verdict is checked against bad results."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
from megatron_launch import run

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import gpu_check_multi as multi  # noqa: E402

SCRIPT = pathlib.Path(__file__).resolve().parent / "mp_scripts" / "dsa_bf16.py"


@pytest.fixture(scope="module")
def cpu_result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("dsa_bf16") / "r.json"
    run(str(SCRIPT), str(out), "--device", "cpu", timeout=600)
    return json.loads(out.read_text())


@pytest.mark.component
def test_dsa_bf16_forward_backward_is_within_the_bf16_bound_of_fp32(cpu_result):
    line = multi.judge_dsa_bf16(cpu_result, device="cpu")
    assert line.status == "PASS", line.text()
    assert cpu_result["params"] == ["cpu", "torch.bfloat16"] and cpu_result["seq_len"] > 8  # top-8 drops keys
    assert cpu_result["logprob_max_diff"] > 0 and cpu_result["grad_rel_err"] > 0  # bf16 really ran
    # The (trainable) gradients of both layers: embeddings, MLA, router, experts, shared expert.
    assert cpu_result["num_grads"] >= 20


@pytest.mark.unit
def test_dsa_bf16_verdict_fails_non_finite_off_device_and_out_of_bound_results():
    ok = {"device": "cuda:0", "params": ["cuda:0", "torch.bfloat16"], "seq_len": 128, "loss_fp32": 4.86,
          "loss_bf16": 4.86, "logprob_max_diff": 0.03, "logprob_mean_diff": 0.002, "grad_rel_err": 0.05,
          "worst_grad_cos": 0.99, "num_grads": 34, "finite": True}
    assert multi.judge_dsa_bf16(ok, device="cuda").status == "PASS"
    for bad in ({"finite": False}, {"grad_rel_err": 0.5}, {"logprob_max_diff": 1.2}, {"worst_grad_cos": 0.3},
                {"params": ["cuda:0", "torch.float32"]}, {"num_grads": 0}):
        assert multi.judge_dsa_bf16(ok | bad, device="cuda").status == "FAIL", bad
    assert multi.judge_dsa_bf16(ok | {"device": "cpu"}, device="cuda").status == "FAIL"
