"""The embedded engine's routed experts for GLM-4.5-style MoE (sigmoid router, expert-score bias, a
dense first layer), in SGLang's layout: [prompt + output - 1, num_hidden_layers, topk], dense layers 0.

ModelRunner directly (prefill + batched decode, as the engine thread drives it); the reference is a
slow top-k recomputed from each router's input hidden states, independently of the gate module.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.component


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(0)
    cfg = Glm4MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        max_position_embeddings=128, tie_word_embeddings=False)
    model = Glm4MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.2)  # the bias must steer the choice
    out = tmp_path_factory.mktemp("glm") / "m"
    model.save_pretrained(out)
    return out


def reference_routes(model, tokens: list[int]) -> np.ndarray:
    """[len(tokens), layers, 2]: top-2 of sigmoid(h W^T) + bias (n_group = 1) from each gate's input h."""
    inputs = {}
    hooks = [layer.mlp.gate.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0]))
             for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    out = np.zeros((len(tokens), len(model.model.layers), 2), np.int32)
    for i, h in inputs.items():
        gate = model.model.layers[i].mlp.gate
        choice = torch.sigmoid(h.reshape(-1, h.shape[-1]) @ gate.weight.T) + gate.e_score_correction_bias
        out[:, i] = choice.topk(2, dim=-1).indices.numpy()
    return out


def test_routes_of_prefill_and_decode_rows_in_sglang_layout(glm_dir):
    from sao_megatron.rollout.engine.model import ModelRunner

    runner = ModelRunner(glm_dir)
    prompts, steps = [[3, 4, 5, 6], [7, 8]], 5
    fwds = [runner.prefill(p, record_routing=True) for p in prompts]
    rows = [[f.routing[0]] for f in fwds]
    caches = [f.caches[0] for f in fwds]
    seqs = [list(p) + [int(f.logits_bv[0].argmax())] for p, f in zip(prompts, fwds)]
    for _ in range(steps):  # both requests in one batched decode step each time
        fwd = runner.decode([s[-1] for s in seqs], caches, record_routing=True)
        caches = fwd.caches
        for i, s in enumerate(seqs):
            rows[i].append(fwd.routing[i])
            s.append(int(fwd.logits_bv[i].argmax()))
    for seq, got in zip(seqs, rows):
        got = np.concatenate(got)
        assert got.shape == (len(seq) - 1, 3, 2) and got.dtype == np.int32  # prompt + output - 1 rows
        assert not got[:, 0].any()  # the dense layer reads 0, as SGLang sends it
        want = reference_routes(runner.model, seq[:-1])
        np.testing.assert_array_equal(np.sort(got[:, 1:], -1), np.sort(want[:, 1:], -1))
