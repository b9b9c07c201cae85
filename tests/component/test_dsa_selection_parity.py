"""Train/inference consistency of DeepSeek sparse attention: the trainer's indexer picks the same keys.

A tiny GLM-5 (full/shared/full/shared indexer layers, top-8, 16 indexer heads) converted to
Megatron; both sides run the same 4 x 40 tokens (5x the top-k) and every full indexer layer's
top-k set is compared per query (restricted to causal keys: queries with fewer than 8 keys
select all of them, padded differently by the two implementations). Measured: 0 of 160 query
rows differ in either full layer and fp32 logits agree to ~1e-6 (docs/mla-dsa.md).
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "convert_scripts"))
from mla_fixtures import SHAPES, write_hf_dir, write_hub_dir  # noqa: E402

pytestmark = pytest.mark.component
NAME, BATCH, SEQ = "glm5_shared_idx_mtp", 4, 40
# DeepSeek-V3.2: the GLM-5 fixture's sizes, an indexer in every layer, half-split indexer rope.
DSV32 = {k: v for k, v in SHAPES[NAME].items() if k != "indexer_types"} | {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "index_n_heads": 16,
    "num_nextn_predict_layers": 0}


@pytest.fixture(scope="module")
def ctx(megatron_ctx):
    """Megatron in this process for this module only (see conftest.megatron_ctx)."""
    return megatron_ctx


def megatron_selection(hf_dir, ctx, tokens):
    from megatron.core.transformer.experimental_attention_variant import dsa

    from checkpoints_tools.hf_to_mcore import open_hf
    from checkpoints_tools.parity import megatron_logits
    from sao_megatron.models.builder import build_model_chunks
    from sao_megatron.models.families.sharded import load_hf_weights

    src = open_hf(hf_dir, dtype="fp32")
    chunks = build_model_chunks(src.model_cfg, ctx)
    load_hf_weights(chunks, src.wmap, src.ckpt)
    picked, real = [], dsa.fused_qk_topk_naive

    def recording(*args, **kwargs):
        scores, topk = real(*args, **kwargs)
        picked.append(topk.detach().clone())
        return scores, topk
    dsa.fused_qk_topk_naive = recording
    try:
        logits = megatron_logits(chunks, ctx, tokens, src.model_cfg.vocab_size)
    finally:
        dsa.fused_qk_topk_naive = real
    return picked, logits


def hf_selection(hf_dir, tokens):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager").eval()
    picked = []
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda _m, _i, out: picked.append(out.clone()))
             for layer in model.model.layers if layer.self_attn.indexer is not None]
    try:
        with torch.no_grad():
            logits = model(input_ids=tokens).logits
    finally:
        for h in hooks:
            h.remove()
    return picked, logits


def differing_rows(a_bsk: torch.Tensor, b_bsk: torch.Tensor) -> int:
    """Query rows whose sets of selected causal keys differ."""
    bad = 0
    for b in range(a_bsk.shape[0]):
        for t in range(a_bsk.shape[1]):
            keep = lambda idx: {int(i) for i in idx if 0 <= int(i) <= t}  # noqa: E731
            bad += keep(a_bsk[b, t]) != keep(b_bsk[b, t])
    return bad


def test_trainer_and_engine_indexers_select_the_same_keys(ctx, tmp_path):
    hf_dir = write_hf_dir(NAME, tmp_path / "hf", seed=0, index_n_heads=16)
    tokens = torch.randint(0, 96, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    mcore, mcore_logits = megatron_selection(hf_dir, ctx, tokens)
    hf, hf_logits = hf_selection(hf_dir, tokens)
    check_same_selection(mcore, hf, SHAPES[NAME]["indexer_types"].count("full"))
    assert float((mcore_logits - hf_logits).abs().max()) < 1e-4
    # teeth: a selection from other tokens differs in most rows
    assert differing_rows(mcore[0], mcore[0].roll(1, dims=0)) > BATCH * SEQ // 2


def test_deepseek_v32_maps_like_glm5_with_half_split_indexer_rope(ctx, tmp_path):
    """DeepSeek-V3.2 converts with GLM-5's mapping: same logits and top-k sets as transformers."""
    import dataclasses

    from checkpoints_tools.hf_to_mcore import open_hf
    from checkpoints_tools.parity import check_parity
    from sao_megatron.models.builder import build_model_chunks
    from sao_megatron.models.families import hf_config_from_model
    from sao_megatron.models.families.sharded import load_hf_weights

    hf_dir = write_hub_dir(DSV32, tmp_path / "hf", seed=0)
    tokens = torch.randint(0, 96, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    mcore, mcore_logits = megatron_selection(hf_dir, ctx, tokens)
    hf, hf_logits = hf_selection(hf_dir, tokens)
    check_same_selection(mcore, hf, DSV32["num_hidden_layers"])
    assert float((mcore_logits - hf_logits).abs().max()) < 1e-4
    src = open_hf(hf_dir, dtype="fp32")
    assert hf_config_from_model(src.model_cfg)["model_type"] == "deepseek_v32"
    # teeth: GLM-5's interleaved indexer rope changes the selection and the logits
    chunks = build_model_chunks(dataclasses.replace(src.model_cfg, dsa_indexer_rope_interleaved=True), ctx)
    load_hf_weights(chunks, src.wmap, src.ckpt)
    assert check_parity(hf_dir, chunks, ctx, 96, batch=BATCH, seq_len=SEQ).max_abs_diff > 1e-3


def check_same_selection(mcore: list[torch.Tensor], hf: list[torch.Tensor], full_layers: int) -> None:
    assert len(mcore) == len(hf) == full_layers
    for layer, (m, h) in enumerate(zip(mcore, hf)):
        assert m.shape == h.shape == (BATCH, SEQ, SHAPES[NAME]["index_topk"])
        assert differing_rows(m, h) == 0, f"full indexer layer {layer}"
