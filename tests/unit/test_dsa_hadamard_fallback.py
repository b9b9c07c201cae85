"""DSA's Hadamard rotation wherever the kernel is missing (issue 37, defect 7).

megatron's ``dsa.rotate_activation`` asserts ``fast_hadamard_transform`` (CUDA only, an optional
sdist); the pure-torch ``hadamard_rotate`` used to be put in only by the CPU shims, so a CUDA node
without the kernel failed at the first DSA forward. The builder now applies the fallback wherever
the kernel is not importable (tests/component/test_device_placement.py runs it through a build
on an emulated CUDA node; here: the decision, the patch, its log line and version guard, bf16).
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from sao_megatron.parallel import cpu_support
from sao_megatron.parallel.cpu_support import hadamard_fallback_needed, hadamard_rotate

pytestmark = pytest.mark.unit
CUDA0 = torch.device("cuda", 0)


@pytest.mark.parametrize("device,importable,needed", [
    ("cpu", False, True), ("cpu", True, True),  # the kernel is CUDA-only
    ("cuda", False, True), ("cuda", True, False),
])
def test_fallback_wherever_the_kernel_cannot_run(device, importable, needed):
    assert hadamard_fallback_needed(torch.device(device), kernel_importable=importable) is needed


@pytest.fixture
def dsa(monkeypatch):
    """megatron's dsa module as on a CUDA node without the kernel (attributes restored after the test)."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    monkeypatch.setattr(dsa, "hadamard_transform", None)
    monkeypatch.setattr(dsa, "rotate_activation", dsa.rotate_activation)
    monkeypatch.setattr(cpu_support, "_SKIPPED", set())
    return dsa


def test_cuda_without_the_kernel_gets_the_fallback_logged_once(dsa, caplog):
    """Failed before: only the CPU shims replaced rotate_activation; on CUDA it asserted the kernel."""
    with pytest.raises(AssertionError, match="fast_hadamard_transform is not installed"):
        dsa.rotate_activation(torch.zeros(2, 4, dtype=torch.bfloat16))  # what a GPU node without it hit
    with caplog.at_level(logging.WARNING, logger=cpu_support.__name__):
        assert cpu_support.apply_dsa_hadamard_fallback(CUDA0)
        assert cpu_support.apply_dsa_hadamard_fallback(CUDA0)  # a second build: already in place
    assert dsa.rotate_activation is hadamard_rotate
    assert [r.getMessage() for r in caplog.records] == [
        "fast_hadamard_transform is not importable on cuda:0: the DSA indexer's Hadamard rotation runs in pure "
        "torch (cpu_support.hadamard_rotate, fp32 inside, same result)"]


def test_cuda_with_the_kernel_keeps_megatrons_rotation(dsa, monkeypatch):
    monkeypatch.setattr(dsa, "hadamard_transform", object())  # importable
    before = dsa.rotate_activation
    assert not cpu_support.apply_dsa_hadamard_fallback(CUDA0)
    assert dsa.rotate_activation is before


def test_an_unaudited_megatron_is_refused_with_the_fix(dsa, monkeypatch):
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", "0.20.0")
    with pytest.raises(cpu_support.MegatronVersionError, match="0.20.0.*pip install fast-hadamard-transform"):
        cpu_support.apply_dsa_hadamard_fallback(CUDA0)


def sylvester(d: int) -> torch.Tensor:
    """H_d by the Sylvester construction, float64 (the obviously-correct reference)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("d", [64, 128])
def test_bf16_rotation_rounds_once_like_the_kernel(d):
    """bf16 indexer q as megatron lays it out ([s, b, heads, d], here a non-contiguous view): the result
    equals x @ H / sqrt(d) computed in float64 from the same bf16 input, up to bf16's one final rounding
    (|err| <= 2^-8 |y|: unit roundoff of an 8-bit significand) plus fp32's log2(d) butterfly stages
    (each <= 2^-24 of the running sum, bounded by sum|x| / sqrt(d)). Failed before: 16-bit inputs were
    rotated in 16-bit, rounding at every stage."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, 32, d, generator=g).to(torch.bfloat16).transpose(0, 1)  # [s=64, b=2, h=32, d]
    out = hadamard_rotate(x)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    ref = x.double() @ sylvester(d) / math.sqrt(d)
    fp32_bound = math.log2(d) * 2.0 ** -24 * x.double().abs().sum(-1, keepdim=True) / math.sqrt(d)
    err = (out.double() - ref).abs()
    assert (err <= 2.0 ** -8 * ref.abs() + fp32_bound).all(), float((err / ref.abs().clamp_min(1e-6)).max())
