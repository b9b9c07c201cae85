"""benchmarks/train_step.py (issue 37): the actor's and the critic's training step through the
project's step code, with tokens/s, TFLOP/s, MFU and the phase shares. On a GPU gpu_check.sh runs
the ~1B shape; here the tiny shape runs on the CPU beside HF transformers, and its report is checked
for consistency against an independent count of the tiny MoE's matmul weights."""

from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest
from megatron_launch import run

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import train_step  # noqa: E402

SCRIPT = REPO / "benchmarks" / "train_step.py"


def tiny_matmul_weights(critic: bool) -> int:
    """configs/models/tiny_moe.yaml by hand: per layer q (h x n_h·d_h), k and v (h x n_g·d_h each), the
    output projection, the router (E x h) and top-k of E experts (SwiGLU: h x 2f and f x h); then the
    LM head (V x h, V = 128 needs no padding) or the critic's value head (h x 1)."""
    h, n_h, n_g, d_h, num_experts, topk, f, vocab, layers = 64, 4, 2, 16, 4, 2, 64, 128, 2
    attention = h * n_h * d_h + 2 * h * n_g * d_h + n_h * d_h * h
    layer = attention + num_experts * h + topk * (h * 2 * f + f * h)
    return layers * layer + (h if critic else vocab * h)


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("train_step") / "r.json"
    proc = run(str(SCRIPT), "--device", "cpu", "--shape", "tiny", "--warmup", "1", "--steps", "2",
               "--peak-tflops", "0.5", "--json", str(out), timeout=600)
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.component
def test_train_step_report_is_consistent_and_counts_the_models_flops(result):
    res, stdout = result
    seq, mbs = res["seq_len"], res["microbatches"]
    attn = 2 * 2 * 4 * 16 * seq * seq  # 2·L·n_h·d_h·s·T for one row of s tokens
    for role in ("actor", "critic", "hf_actor"):
        r = res[role]
        assert math.isclose(sum(r["share"].values()), 1.0, rel_tol=1e-9), r["share"]
        assert math.isclose(sum(r["phase_s"].values()), r["step_s"], rel_tol=1e-9)
        assert all(r["phase_s"][p] > 0 for p in ("forward", "backward", "optimizer")), r["phase_s"]
        assert math.isclose(r["tflops"], r["flops_per_step"] / r["step_s"] / 1e12, rel_tol=1e-9)
        assert math.isclose(r["tokens_per_s"], seq * mbs / r["step_s"], rel_tol=1e-9)
        assert math.isclose(r["mfu"], r["tflops"] / 0.5, rel_tol=1e-9)
        assert r["forward_calls"] == r["backward_calls"] == mbs and r["peak_mem_gib"] is None
    n = tiny_matmul_weights(critic=False)
    assert res["actor"]["params_active"] == n
    # Every actor weight trains: backward = 2 x forward, 6·N·T + 6·L·n_h·d_h·s·T a step.
    assert res["actor"]["flops_per_step"] == mbs * (6 * n * seq + 3 * attn)
    assert res["critic"]["params_active"] == tiny_matmul_weights(critic=True)
    # The critic's frozen attention and embedding get no weight gradients: cheaper than 6·N·T.
    assert res["critic"]["flops_per_step"] < mbs * (6 * res["critic"]["params_active"] * seq + 3 * attn)
    assert res["hf_actor"]["flops_per_step"] == res["actor"]["flops_per_step"]
    assert res["actor"]["params_total"] == res["hf_actor"]["params_total"]  # the same shape in both
    assert res["actor"]["phase_s"]["grad_reduce"] > 0 and res["hf_actor"]["phase_s"]["grad_reduce"] == 0
    assert "actor vs HF transformers eager on the same shape" in stdout


@pytest.mark.unit
def test_timeline_puts_every_interval_in_the_phase_that_opened_it():
    tl = train_step.Timeline(train_step.torch.device("cpu"))
    tl.marks = [("other:start", 0.0), ("forward:start", 1.0), ("forward:end", 3.0), ("backward:start", 3.5),
                ("backward:end", 7.5), ("optimizer:start", 8.0), ("optimizer:end", 9.0), ("other:end", 9.25)]
    assert tl.totals() == {"forward": 2.0, "backward": 4.0, "grad_reduce": 0.0, "optimizer": 1.0, "other": 2.25}


@pytest.mark.unit
def test_peak_table_matches_device_names_most_specific_first():
    assert train_step.peak_for("NVIDIA H100 80GB HBM3") == 989.0
    assert train_step.peak_for("NVIDIA H100 PCIe") == 756.0
    assert train_step.peak_for("NVIDIA H200") == 989.0 and train_step.peak_for("NVIDIA GH200 480GB") == 989.0
    assert train_step.peak_for("NVIDIA A100-SXM4-80GB") == 312.0
    assert train_step.peak_for("Some Future GPU") is None
