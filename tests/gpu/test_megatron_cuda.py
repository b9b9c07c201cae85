"""GPU only: the actor and the critic train on CUDA with bf16 params, fp32 grads, distributed optimizer.

mp_scripts/megatron_cuda.py builds the tiny MoE in fp32 (reference) and bf16 (same weights) and
records what these tests assert (see its docstring).
"""

from __future__ import annotations

import pytest
from megatron_launch import run_json

pytestmark = [pytest.mark.gpu, pytest.mark.component]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    import pathlib

    script = pathlib.Path(__file__).resolve().parent / "mp_scripts" / "megatron_cuda.py"
    out = run_json(str(script), tmp_path_factory.mktemp("megatron_cuda"), timeout=300)
    print(f"\nGPU_CHECK_NUMBERS test_actor_bf16_params_fp32_grads_distributed_optimizer_on_cuda: "
          f"bf16 vs fp32 max |Δlogp| {out['logprob_bf16_vs_fp32_maxdiff']:.1e}, grad cosine "
          f"{out['grad_cosine']:.4f} (rel err {out['grad_rel_err']:.1e}), actor losses "
          + " ".join(f"{x:.4f}" for x in out["actor_losses"]) + "; critic losses "
          + " ".join(f"{x:.4f}" for x in out["critic_losses"]))
    return out


def test_actor_bf16_params_fp32_grads_distributed_optimizer_on_cuda(result):
    actor = result["actor"]
    assert result["device"].startswith("cuda")
    assert actor["param_devices"] == ["cuda:0"] and actor["param_dtypes"] == ["torch.bfloat16"]
    assert actor["main_grad_dtypes"] == ["torch.float32"] and actor["main_grad_devices"] == ["cuda:0"]
    assert "DistributedOptimizer" in str(result["actor_optimizer"])
    losses = result["actor_losses"]
    assert all(a > b for a, b in zip(losses, losses[1:])), losses  # a fixed batch: every step lowers the loss


def test_bf16_forward_and_backward_agree_with_fp32(result):
    # Log-probs of a 4-layer model with O(1) logits: bf16 rounding (2^-9 relative) gives ~1e-2 at most.
    assert result["logprob_bf16_vs_fp32_maxdiff"] < 5e-2
    # The fp32 main gradients of the bf16 model point where the fp32 model's do.
    assert result["grad_cosine"] > 0.99 and result["grad_rel_err"] < 0.15


@pytest.mark.parametrize("key", ["critic", "critic_plain"])
def test_critic_trains_on_cuda_with_frozen_attention(result, key):
    """Distributed and plain optimizer: the value head lives on the GPU, only the trainable set moves."""
    assert result[f"{key}_value_head"] == ["cuda:0/torch.bfloat16"]
    assert result[key]["param_devices"] == ["cuda:0"]
    assert result[f"{key}_values_device"].startswith("cuda")
    assert result[f"{key}_frozen_changed"] == [] and result[f"{key}_trainable_unchanged"] == []
    assert result[f"{key}_num_trainable"] > 0
    losses = result[f"{key}_losses"]
    assert losses[-1] < losses[0], losses
