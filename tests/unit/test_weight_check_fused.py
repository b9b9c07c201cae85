"""Checksums under SGLang's fused parameter names (qkv_proj, gate_up_proj, experts.w13_weight/w2_weight)
against a slow reference that builds each fused tensor with torch.cat/stack and hashes its bytes."""

from __future__ import annotations

import hashlib

import pytest
import torch

from sao_megatron.rollout.weight_check import (
    StreamingChecksums, WeightMismatchError, compare_checksums, expected_checksums, held_checksums, held_name)

pytestmark = pytest.mark.unit
E, H, I = 3, 8, 4  # experts, hidden, expert intermediate


def checkpoint() -> dict[str, torch.Tensor]:
    """One Qwen3-MoE-like layer plus a dense MLP layer, in HF checkpoint names."""
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(10, H, generator=g)}
    a = "model.layers.0.self_attn."
    t |= {a + "q_proj.weight": torch.randn(8, H, generator=g), a + "k_proj.weight": torch.randn(4, H, generator=g),
          a + "v_proj.weight": torch.randn(4, H, generator=g), a + "o_proj.weight": torch.randn(H, 8, generator=g)}
    m = "model.layers.0.mlp."
    t[m + "gate.weight"] = torch.randn(E, H, generator=g)
    for e in range(E):
        t |= {f"{m}experts.{e}.gate_proj.weight": torch.randn(I, H, generator=g),
              f"{m}experts.{e}.up_proj.weight": torch.randn(I, H, generator=g),
              f"{m}experts.{e}.down_proj.weight": torch.randn(H, I, generator=g)}
    d = "model.layers.1.mlp."
    t |= {d + "gate_proj.weight": torch.randn(I, H, generator=g), d + "up_proj.weight": torch.randn(I, H, generator=g),
          d + "down_proj.weight": torch.randn(H, I, generator=g)}
    return t


def reference_held(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors SGLang holds, built the obvious way."""
    a, m, d = "model.layers.0.self_attn.", "model.layers.0.mlp.", "model.layers.1.mlp."
    return {"model.embed_tokens.weight": t["model.embed_tokens.weight"], a + "o_proj.weight": t[a + "o_proj.weight"],
            a + "qkv_proj.weight": torch.cat([t[a + "q_proj.weight"], t[a + "k_proj.weight"], t[a + "v_proj.weight"]]),
            m + "gate.weight": t[m + "gate.weight"],
            m + "experts.w13_weight": torch.stack([torch.cat([t[f"{m}experts.{e}.gate_proj.weight"],
                                                              t[f"{m}experts.{e}.up_proj.weight"]]) for e in range(E)]),
            m + "experts.w2_weight": torch.stack([t[f"{m}experts.{e}.down_proj.weight"] for e in range(E)]),
            d + "gate_up_proj.weight": torch.cat([t[d + "gate_proj.weight"], t[d + "up_proj.weight"]]),
            d + "down_proj.weight": t[d + "down_proj.weight"]}


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).digest()[:8].hex()


def test_fused_checksums_equal_the_hash_of_the_fused_tensors():
    t = checkpoint()
    expected = {n: sha(x) for n, x in reference_held(t).items()}
    assert held_checksums(reversed(list(t.items()))) == expected  # whatever order the parts come in
    assert held_name("model.layers.0.mlp.experts.2.down_proj.weight") == "model.layers.0.mlp.experts.w2_weight"


def test_parts_split_over_chunks_stay_unfused_and_are_not_required():
    """A fused parameter whose parts are exported in two chunks cannot be hashed as held: its parts keep
    their checkpoint names, and a strict comparison neither fails on them nor counts them."""
    t = checkpoint()
    names = list(t)
    cut = names.index("model.layers.0.mlp.experts.1.up_proj.weight")
    sums = {**expected_checksums([(n, t[n]) for n in names[:cut]]),
            **expected_checksums([(n, t[n]) for n in names[cut:]])}
    assert "model.layers.0.mlp.experts.w13_weight" not in sums and "model.layers.0.mlp.experts.1.up_proj.weight" in sums
    engine = {n: sha(x) for n, x in reference_held(t).items()}
    compared = compare_checksums(sums, engine, where="engine", require_all=True)
    assert compared == len(engine) - 2  # all but w13/w2 (the router came in the first chunk only)
    with pytest.raises(WeightMismatchError, match="qkv_proj"):
        compare_checksums(sums, engine | {"model.layers.0.self_attn.qkv_proj.weight": "0" * 16}, where="engine")
    with pytest.raises(WeightMismatchError, match="1 missing"):
        compare_checksums(sums, {k: v for k, v in engine.items() if "o_proj" not in k}, where="engine")


def _streamed(pieces) -> dict[str, str]:
    stream = StreamingChecksums()
    for piece in pieces:
        stream.update(piece)
    return stream.result()


def test_streamed_checksums_hash_fused_parameters_across_every_cut():
    """Disk shards and distributed buckets cut the export anywhere: hashed across pieces, every fused
    parameter is still checked as the engine holds it, wherever the cut falls (per piece, a cut inside
    q/k/v or an expert group left that parameter unverified)."""
    t = checkpoint()
    items = list(t.items())
    expected = {n: sha(x) for n, x in reference_held(t).items()}
    for cut in range(len(items) + 1):
        assert _streamed([items[:cut], items[cut:]]) == expected, cut
    assert _streamed([[item] for item in items]) == expected  # one tensor per piece
    assert _streamed([[item] for item in reversed(items)]) == expected  # parts ahead of their place wait


def test_streamed_checksums_leave_a_rank_share_of_experts_unfused():
    """A rank that exports experts 0 and 1 of 3 (expert parallelism) cannot form w13/w2: those parts keep
    their checkpoint names, which the comparison counts as not checked, never as equal."""
    t = checkpoint()
    share = [(n, x) for n, x in t.items() if ".experts.2." not in n]
    sums = _streamed([share])
    engine = {n: sha(x) for n, x in reference_held(t).items()}
    assert "model.layers.0.mlp.experts.w13_weight" not in sums and "model.layers.0.mlp.experts.0.gate_proj.weight" in sums
    assert compare_checksums(sums, engine, where="engine") == len(engine) - 2
    assert len(sums) - compare_checksums(sums, engine, where="engine") == 6  # 2 experts x (gate, up, down)


def test_streamed_checksums_catch_a_changed_part():
    t = checkpoint()
    items = list(t.items())
    sums = _streamed([items[:7], items[7:]])
    engine = {n: sha(x) for n, x in reference_held(t).items()}
    t["model.layers.0.mlp.experts.1.up_proj.weight"][0, 0] += 1
    with pytest.raises(WeightMismatchError, match="w13_weight"):
        compare_checksums(sums, {n: sha(x) for n, x in reference_held(t).items()}, where="engine")
    assert compare_checksums(sums, engine, where="engine") == len(engine)
