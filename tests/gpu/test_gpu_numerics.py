"""GPU only: GAE scan and chunked log-probs on CUDA against slow float64 references.

Each test prints a ``GPU_CHECK_NUMBERS <test>: ...`` line that scripts/gpu_check.sh shows on the
test's line.
"""

from __future__ import annotations

import random

import algo_reference as ref
import pytest
import torch

from sao_megatron.algorithms.advantages import gae
from sao_megatron.models.actor import token_logprobs

pytestmark = pytest.mark.gpu


def numbers(request, text: str) -> None:
    """Shown on the test's line by scripts/gpu_check.sh (it runs pytest with -s)."""
    print(f"\nGPU_CHECK_NUMBERS {request.node.name}: {text}")


@pytest.mark.parametrize("skip_observations", [True, False])
def test_gae_scan_on_cuda_matches_reference_loop(request, skip_observations):
    rng = random.Random(0)
    mask = ref.multi_turn_mask(rng, 12, 300)
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(12, 300, generator=g) * (torch.rand(12, 300, generator=g) < 0.05)
    values = torch.randn(12, 300, generator=g)
    want_adv, want_ret = ref.gae(rewards, values, mask, 0.99, 0.95, skip_observations)
    adv, ret = gae(rewards.cuda(), values.cuda(), mask.cuda(), gamma=0.99, lam=0.95,
                   skip_observations=skip_observations)
    assert adv.is_cuda and ret.is_cuda
    err = max(float((adv.cpu().double() - want_adv).abs().max()), float((ret.cpu().double() - want_ret).abs().max()))
    numbers(request, f"[12, 300] fp32 cuda vs float64 loop: max |diff| {err:.1e} (tol 1e-4)")
    assert err < 1e-4


def test_gae_on_cuda_matches_cpu_at_32k(request):
    """At production length the CUDA scan equals the CPU implementation (kernel or scan) in float64."""
    rng = random.Random(2)
    mask = ref.multi_turn_mask(rng, 8, 32768, min_run=16, max_run=512)
    g = torch.Generator().manual_seed(3)
    rewards = (torch.randn(8, 32768, generator=g) * (torch.rand(8, 32768, generator=g) < 0.01)).double()
    values = torch.randn(8, 32768, generator=g).double()
    cpu = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    cuda = gae(rewards.cuda(), values.cuda(), mask.cuda(), gamma=1.0, lam=0.95)
    err = max(float((a.cpu() - b).abs().max()) for a, b in zip(cuda, cpu))
    numbers(request, f"[8, 32768] fp64 cuda vs cpu: max |diff| {err:.1e} (tol 1e-8)")
    assert err < 1e-8


def _reference(logits, tokens, vocab, temperature):
    logp = torch.log_softmax(logits[:, :-1, :vocab].double() / temperature, dim=-1)
    lp = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    zero = lp.new_zeros(lp.shape[0], 1)
    return torch.cat([zero, lp], 1), torch.cat([zero, ent], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_logprobs_on_cuda_match_float64_reference(request, dtype):
    """Forward (log-probs, entropy) and backward of the chunked Function on CUDA, several chunks per row block."""
    g = torch.Generator(device="cuda").manual_seed(0)
    b, s, v_padded, vocab, temperature = 3, 65, 1280, 1200, 0.7
    logits = (torch.randn(b, s, v_padded, generator=g, device="cuda") * 3).to(dtype)
    logits[..., vocab:] = 1e4  # TP padding columns must not leak into the softmax
    logits.requires_grad_(True)
    tokens = torch.randint(0, vocab, (b, s), generator=g, device="cuda")
    weights = torch.randn(2, b, s, generator=g, device="cuda", dtype=torch.float64)
    lp, ent = token_logprobs(logits, tokens, tp_group=None, vocab_size=vocab, temperature=temperature,
                             chunk_elements=4096)
    (grad,) = torch.autograd.grad((weights[0] * lp).sum() + (weights[1] * ent).sum(), logits)
    leaf = logits.detach().double().requires_grad_(True)
    want_lp, want_ent = _reference(leaf, tokens, vocab, temperature)
    (want_grad,) = torch.autograd.grad((weights[0] * want_lp).sum() + (weights[1] * want_ent).sum(), leaf)
    errs = [float((lp - want_lp).abs().max()), float((ent - want_ent).abs().max()),
            float((grad.double() - want_grad).abs().max())]
    # fp32 math inside either way (the Function upcasts per chunk); bf16 only rounds the gradient it returns.
    tol_grad = 1e-5 if dtype == torch.float32 else 2e-2 * float(want_grad.abs().max())
    numbers(request, f"{str(dtype).split('.')[-1]} [3, 65, 1280] chunks of 4096: max |Δlogp| {errs[0]:.1e}, "
            f"|Δentropy| {errs[1]:.1e}, |Δgrad| {errs[2]:.1e} (tol 1e-4, 1e-4, {tol_grad:.0e})")
    assert lp.is_cuda and lp.dtype == torch.float32
    assert errs[0] < 1e-4 and errs[1] < 1e-4 and errs[2] < tol_grad
