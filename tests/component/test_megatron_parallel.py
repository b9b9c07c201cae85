"""Parallel layouts agree with the single-device reference (one torchrun launch with 4 gloo ranks).

Weights are written once at TP1/PP1/EP1 and loaded through the same distributed checkpoint
into TP2×EP2 (expert-TP 2) + sequence parallel, PP2, EP2×DP2 and PP2×VPP2×TP2+SP; see
mp_scripts/megatron_layouts.py for what each number is. Tolerances are fp32 reduction-order
noise; the model is GLM-flavoured (sigmoid router, expert bias, scaling, QKV bias, partial RoPE,
shared experts, a dense first layer) and its vocabulary is TP-padded.
"""

from __future__ import annotations

import math

import pytest

from megatron_launch import run_json

pytestmark = pytest.mark.component

LAYOUTS = ["tp2_ep2_sp", "pp2", "ep2_dp2", "pp2_vpp2_tp2_sp"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron_layouts")
    return run_json("megatron_layouts.py", tmp, "--hang-timeout", "600", nproc=4, timeout=900, light_main=True)


def close(a: list[float], b: list[float], rel: float) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rel, abs_tol=1e-7) for x, y in zip(a, b))


def test_reference_run_is_meaningful(results):
    # Log-probs of random tokens under a random model sit near -log(vocab) = -4.6 per token.
    assert -10 < results["ref_logprob_mean"] < 0
    for key in ("actor_losses", "critic_losses"):
        losses = results[key]["ref"]
        assert losses[0] > losses[1] > losses[2], (key, losses)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logprobs_and_entropy_equal_reference_layout(results, layout):
    assert results["logprob_maxdiff"][layout] < 2e-5
    assert results["entropy_maxdiff"][layout] < 2e-5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_actor_training_equals_reference_layout(results, layout):
    assert close(results["actor_losses"][layout], results["actor_losses"]["ref"], 1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_critic_training_equals_reference_layout(results, layout):
    assert close(results["critic_losses"][layout], results["critic_losses"]["ref"], 1e-5)


@pytest.mark.parametrize("layout", ["ref", *LAYOUTS])
def test_frozen_critic_params_bit_identical_and_trainable_ones_change(results, layout):
    assert results["num_frozen"][layout] > 0 and results["num_trainable"][layout] > 0
    assert results["frozen_changed"][layout] == []
    assert results["trainable_unchanged"][layout] == []


@pytest.mark.parametrize("layout", ["ref", "ep2_dp2"])
def test_distributed_and_plain_optimizer_give_same_losses(results, layout):
    assert close(results["critic_losses_plain_optimizer"][layout], results["critic_losses"][layout], 1e-6)


def test_critic_and_optimizer_resume_on_another_layout(results):
    """2 steps at TP2×EP2+SP, checkpoint, 3rd step at TP1 EP2 DP4 == 3 uninterrupted steps."""
    assert results["resume_extra"] == {"steps": 2}
    assert close(results["resume_losses"], results["critic_losses"]["ref"], 1e-5)
