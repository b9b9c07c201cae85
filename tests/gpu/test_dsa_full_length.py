"""DSA at full length (issue 25): megatron's kernel backend is configured, and the planner's memory
follows it.

megatron-core 0.19.2's unfused DSA path (``dsa_kernel_backend: none``) materialises fp32 index
scores ``[s, b, index_heads, s]`` and attention scores ``[b, heads / tp, s, s]``; the planner used
to assume memory linear in tokens, so the GLM-5 16k layout "fit" while one layer needed 64 GiB.
The reference sizes here are the tensors themselves (meta tensors of megatron's shapes), not the
planner's formula. Each test failed on the code before the fix (no backend field, a linear
planner, no refusal, the loss coefficient hard-wired off).
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from sao_megatron.config import load_config
from sao_megatron.launch import planner

pytestmark = pytest.mark.unit
REPO = pathlib.Path(__file__).resolve().parents[2]
GLM5_16K = REPO / "configs" / "experiments" / "sao-math-glm-5-744b-a40b-h200.yaml"
GIB = 2**30


def _plan(backend: str):
    cfg = load_config(GLM5_16K, [f"model.dsa_kernel_backend={backend}"])
    return cfg, planner.make_plan(cfg, suggest=False)


def _nbytes(*shape: int, dtype=torch.float32) -> int:
    return torch.empty(shape, dtype=dtype, device="meta").nbytes


def test_planner_memory_of_the_unfused_dsa_path_is_the_quadratic_tensors_at_16k():
    cfg, unfused = _plan("none")
    _, fused = _plan("tilelang")
    m, lay = cfg.model, planner.layout_from_config(cfg.parallel, cfg.resources)
    s, b = cfg.data.max_total_tokens, cfg.actor.max_tokens_per_microbatch // cfg.data.max_total_tokens
    assert (s, b, m.dsa_indexer_n_heads, lay.tp) == (16384, 1, 32, 8)  # the configured 16k layout
    index_scores = _nbytes(s, b, m.dsa_indexer_n_heads, s)  # dsa._compute_index_scores' einsum output
    assert index_scores == 32 * GIB  # 34.4 GB
    attention = _nbytes(b, m.num_attention_heads // lay.tp, s, s) + _nbytes(b, s, s)  # scores + top-k mask
    assert 2 * index_scores > 2 * attention  # the indexer phase is the peak at this layout
    # Full recompute: nothing quadratic is kept across layers; the peak is one layer's indexer, twice.
    extra = (unfused.actor.activations_gib - fused.actor.activations_gib) * GIB
    fused_linear = 2 * _nbytes(b, s, m.dsa_indexer_topk, dtype=torch.int32)
    assert extra == pytest.approx(2 * index_scores - fused_linear, rel=1e-6)
    assert unfused.actor.activations_gib > 64 and fused.actor.activations_gib < 8


def test_the_16k_layout_is_refused_unfused_and_fits_with_tilelang():
    _, unfused = _plan("none")
    errors = [e for e in unfused.errors if "dsa_kernel_backend=none" in e]
    assert errors and "max_total_tokens=16384" in errors[0] and "64.0 GiB" in errors[0]
    assert "dsa_kernel_backend=tilelang" in errors[0]
    assert not unfused.fits
    cfg = load_config(GLM5_16K)
    assert cfg.model.dsa_kernel_backend == "tilelang"  # what the shipped GPU layouts configure
    fused = planner.make_plan(cfg, suggest=False)
    assert fused.fits and not [e for e in fused.errors if "dsa" in e]


def test_a_shorter_sequence_is_named_when_one_fits():
    cfg = load_config(GLM5_16K, ["model.dsa_kernel_backend=none", "resources.gpu_mem_gb=180"])
    plan = planner.make_plan(cfg, suggest=False)
    err = next(e for e in plan.errors if "dsa_kernel_backend=none" in e)
    fits = int(err.split("cap data.max_total_tokens at ")[1].split()[0])
    shorter = load_config(GLM5_16K, ["model.dsa_kernel_backend=none", "resources.gpu_mem_gb=180",
                                     f"data.max_total_tokens={fits}"])
    assert planner.make_plan(shorter, suggest=False).trainer_peak_gib <= plan.budget_gib
    longer = load_config(GLM5_16K, ["model.dsa_kernel_backend=none", "resources.gpu_mem_gb=180",
                                    f"data.max_total_tokens={2 * fits}"])
    assert planner.make_plan(longer, suggest=False).trainer_peak_gib > plan.budget_gib


def test_backend_and_indexer_loss_reach_megatrons_config():
    from sao_megatron.models.builder import build_transformer_config

    cfg = load_config(REPO / "configs" / "experiments" / "tiny_glm5_cpu.yaml",
                      ["model.dsa_indexer_loss_coeff=0.01"])
    tc = build_transformer_config(cfg.model, cfg.parallel, use_te=False, on_cpu=True)
    assert tc.dsa_kernel_backend == "none" and tc.dsa_indexer_loss_coeff == 0.01 and tc.dsa_indexer_use_sparse_loss
    off = load_config(REPO / "configs" / "experiments" / "tiny_glm5_cpu.yaml")
    tc = build_transformer_config(off.model, off.parallel, use_te=False, on_cpu=True)
    assert tc.dsa_indexer_loss_coeff is None  # off: megatron adds no indexer loss
    # megatron's own validation refuses a fused backend without CUDA, naming it.
    fused = load_config(REPO / "configs" / "experiments" / "tiny_glm5_cpu.yaml", ["model.dsa_kernel_backend=tilelang"])
    with pytest.raises(ValueError, match="dsa_kernel_backend=tilelang requires a CUDA device"):
        build_transformer_config(fused.model, fused.parallel, use_te=False, on_cpu=True)
    bad = load_config(REPO / "configs" / "experiments" / "tiny_glm5_cpu.yaml", ["model.dsa_indexer_loss_coeff=-1"])
    with pytest.raises(ValueError, match="dsa_indexer_loss_coeff=-1"):
        build_transformer_config(bad.model, bad.parallel, use_te=False, on_cpu=True)
