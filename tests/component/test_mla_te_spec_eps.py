"""The TE spec of MLA builds the q/kv latent norms with eps 1e-6 (transformers), not layernorm_epsilon.

Transformer Engine cannot run here, so megatron-core's own TE spec functions are run with a
stand-in TE backend (``TESpecProvider`` replaced by classes that record how they were built):
the block spec is exactly the one megatron builds on GPUs, module classes aside. Both shapes are
covered: plain MLA (DeepSeek-V3: norms fused into ``linear_{q,kv}_up_proj``) and DSA's absorbed
MLA (GLM-5: separate ``q_layernorm``/``kv_layernorm``).
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.spec_utils import build_module

from sao_megatron.config import ParallelConfig, load_config

pytestmark = pytest.mark.component
ROOT = pathlib.Path(__file__).resolve().parents[2]


class FakeNorm(torch.nn.Module):
    def __init__(self, config=None, hidden_size=None, eps=1e-5, **_):
        super().__init__()
        self.eps = eps


class FakeNormLinear(torch.nn.Module):
    def __init__(self, input_size, output_size, *, config, **_):
        super().__init__()
        self.eps = config.layernorm_epsilon  # TE's TELayerNormColumnParallelLinear reads it there


class FakeTE(LocalSpecProvider):
    def linear(self):
        return FakeNormLinear

    def column_parallel_layer_norm_linear(self):
        return FakeNormLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        return FakeNorm


@pytest.fixture
def fake_te(monkeypatch):
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as dsa_specs
    from megatron.core.models.gpt import gpt_layer_specs

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", FakeTE)
    monkeypatch.setattr(dsa_specs, "TESpecProvider", FakeTE, raising=False)


def te_attention(model_yaml: str, **overrides):
    from sao_megatron.models.builder import build_transformer_config
    from sao_megatron.models.specs import latent_decoder_block_spec

    model = load_config(ROOT / model_yaml, [f"model.{k}={v}" for k, v in overrides.items()]).model
    config = build_transformer_config(model, ParallelConfig(), use_te=True, on_cpu=True)
    block = latent_decoder_block_spec(config, use_te=True, pp_rank=0, vp_stage=None)
    return config, [layer.submodules.self_attention.submodules for layer in block.layer_specs]


def test_dsa_te_spec_latent_norms_use_eps_1e6(fake_te):
    config, layers = te_attention("configs/models/tiny_glm5.yaml")
    assert config.layernorm_epsilon == 1e-5
    for sub in layers:
        for name, size in (("q_layernorm", config.q_lora_rank), ("kv_layernorm", config.kv_lora_rank)):
            norm = build_module(getattr(sub, name), hidden_size=size, config=config, eps=config.layernorm_epsilon)
            assert isinstance(norm, FakeNorm) and norm.eps == 1e-6, name


def test_mla_te_spec_fused_latent_norms_use_eps_1e6(fake_te):
    config, layers = te_attention("configs/models/tiny_glm5.yaml", experimental_attention_variant="null")
    for sub in layers:
        for name in ("linear_q_up_proj", "linear_kv_up_proj"):
            linear = build_module(getattr(sub, name), 8, 8, config=config, init_method=None, gather_output=False,
                                  bias=False, skip_bias_add=False, is_expert=False)
            assert isinstance(linear, FakeNormLinear) and linear.eps == 1e-6, name
    assert config.layernorm_epsilon == 1e-5  # the model's own norms keep rms_norm_eps


def test_without_the_fix_megatron_would_use_layernorm_epsilon(fake_te, monkeypatch):
    """The stand-in is faithful: megatron's unmodified spec builds the norms with layernorm_epsilon."""
    from sao_megatron.models import specs

    monkeypatch.setattr(specs, "with_latent_norm_eps", lambda block, config: block)
    config, layers = te_attention("configs/models/tiny_glm5.yaml")
    norm = build_module(layers[0].q_layernorm, hidden_size=8, config=config, eps=config.layernorm_epsilon)
    assert norm.eps == 1e-5
