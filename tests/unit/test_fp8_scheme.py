"""FP8 weights chosen by the engine's own ``quantization_config`` (``weights/fp8_block.py``).

References: SGLang 0.5.23's own ``Fp8Config.from_config`` (how it reads the config) and
``is_layer_skipped`` (how ``modules_to_not_convert`` matches) executed from the pinned wheel, the
wheel's model code read with ``ast`` (which linears it builds without a quantization config), and a
per-block loop for the ue8m0 scales.
"""

from __future__ import annotations

import ast
import json
import logging
import pathlib
import sys
from types import MappingProxyType
from typing import Any

import pytest
import torch

from sao_megatron.models.families import get_family, model_config_from_hf
from sao_megatron.rollout import contract
from sao_megatron.weights.fp8_block import (
    ENGINE_UNQUANTIZED, FP8_MAX, SCALE_SUFFIX, Fp8Scheme, engine_scheme, quantize_blocks, requantize)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "component" / "convert_scripts"))
from mla_fixtures import SHAPES  # noqa: E402

import sglang_loader_harness as harness  # noqa: E402

pytestmark = pytest.mark.unit

GLM5_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
            "modules_to_not_convert": ["lm_head", "model.embed_tokens", "layers.0.self_attn.kv_b_proj",
                                       "model.layers.1.mlp.shared_experts"]
            + [f"model.layers.{i}.self_attn.indexer.weights_proj" for i in range(4)]}
"""GLM-5-FP8's scheme (its indexers' weights_proj in bf16), plus two more skipped modules to tell the
config's choice from the model structure."""


class _FakeFp8Config:
    """What ``Fp8Config.from_config`` calls on its class (QuantizationConfig's key helpers) and builds."""

    @staticmethod
    def get_from_keys(config: dict, keys: list[str]) -> Any:
        for key in keys:
            if key in config:
                return config[key]
        raise ValueError(f"none of {keys} in {config}")

    @classmethod
    def get_from_keys_or(cls, config: dict, keys: list[str], default: Any) -> Any:
        try:
            return cls.get_from_keys(config, keys)
        except ValueError:
            return default

    def __init__(self, **kwargs: Any):
        self.kwargs = kwargs


def sglang_reads(qc: dict) -> dict:
    """The fields SGLang's own ``Fp8Config.from_config`` makes of a quantization_config."""
    ns = {"Dict": dict, "Any": Any, "logger": logging.getLogger("sglang-fp8")}
    return contract.source_function("fp8.py", "Fp8Config.from_config", ns)(_FakeFp8Config, qc).kwargs


def sglang_skips(prefix: str, ignored: list[str]) -> bool:
    ns = {"MappingProxyType": MappingProxyType, "Mapping": dict, "List": list}
    ns["_module_path_match"] = contract.source_function("utils.py", "_module_path_match", dict(ns))
    tree = contract.source_tree("utils.py")
    fallback = next(n for n in tree.body if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) ==
                    "_FALLBACK_FUSED_SHARDS")
    ns["_FALLBACK_FUSED_SHARDS"] = ast.literal_eval(fallback.value)
    return contract.source_function("utils.py", "is_layer_skipped", ns)(prefix, ignored)


def _hf_shapes(shape: str) -> dict[str, tuple[int, ...]]:
    cfg = model_config_from_hf(SHAPES[shape])
    return get_family(cfg.family).weight_map(cfg).hf_shapes()


def _engine_quantizes(name: str, shape: tuple[int, ...], ignored: list[str]) -> bool:
    """SGLang's choice: a decoder linear built with the quant config, unless is_layer_skipped says so."""
    if len(shape) != 2 or not name.startswith("model.layers.") or not name.endswith(".weight"):
        return False
    module = name.removesuffix(".weight")
    if module.endswith((".mlp.gate", ".indexer.weights_proj")):  # structure: see the test below
        return False
    param = harness.sglang_param_name(name, fused_indexer=False)
    return not sglang_skips(param.rsplit(".", 1)[0], ignored)


@pytest.mark.parametrize("shape", ["glm5_shared_idx_mtp", "glm5_full_idx", "dsv3_rope_shared2"])
@pytest.mark.parametrize("qc", [GLM5_FP8, {k: v for k, v in GLM5_FP8.items() if k != "modules_to_not_convert"}])
def test_what_is_quantized_is_what_sglang_builds_quantized(shape, qc):
    scheme = Fp8Scheme.from_quantization_config(qc)
    ignored = sglang_reads(qc)["ignored_layers"] or []
    assert sorted(scheme.not_converted) == sorted(ignored)
    shapes = _hf_shapes(shape)
    for name, s in shapes.items():
        assert scheme.quantizes(name, s) == _engine_quantizes(name, s, ignored), name
    if qc is GLM5_FP8 and shape.startswith("glm5"):
        assert not scheme.quantizes("model.layers.0.self_attn.indexer.weights_proj.weight", (4, 32))
        assert not scheme.quantizes("model.layers.0.self_attn.kv_b_proj.weight", (80, 16))
        assert scheme.quantizes("model.layers.1.self_attn.kv_b_proj.weight", (80, 16))
        assert not scheme.quantizes("model.layers.1.mlp.shared_experts.up_proj.weight", (16, 32))
        assert scheme.quantizes("model.layers.0.mlp.shared_experts.up_proj.weight", (16, 32))


def test_expert_entries_match_sglangs_rule():
    ignored = ["model.layers.1.mlp.experts.1.up_proj", "layers.0.mlp.experts"]
    scheme = Fp8Scheme.from_quantization_config(dict(GLM5_FP8, modules_to_not_convert=ignored))
    normalized = sglang_reads(dict(GLM5_FP8, modules_to_not_convert=ignored))["ignored_layers"]
    for name, s in _hf_shapes("glm5_shared_idx_mtp").items():
        assert scheme.quantizes(name, s) == _engine_quantizes(name, s, normalized), name


def test_glm5_fp8_export_keeps_weights_proj_in_bf16_and_uses_the_configs_block():
    qc = dict(GLM5_FP8, weight_block_size=[64, 32])
    gen = torch.Generator().manual_seed(0)
    named = [(n, torch.randn(s, generator=gen)) for n, s in _hf_shapes("glm5_full_idx").items()]
    out = dict(requantize(named, Fp8Scheme.from_quantization_config(qc)))
    proj = "model.layers.1.self_attn.indexer.weights_proj.weight"
    assert out[proj].dtype == torch.float32 and proj + SCALE_SUFFIX not in out
    wk = "model.layers.1.self_attn.indexer.wk.weight"
    assert out[wk].dtype == torch.float8_e4m3fn and out[wk + SCALE_SUFFIX].shape == (1, 1)  # [16, 32] in 64x32
    q_b = "model.layers.0.self_attn.q_b_proj.weight"
    assert out[q_b + SCALE_SUFFIX].shape == (1, 1) and out[q_b].shape == (64, 16)


def test_the_structural_exclusions_are_sglangs():
    """SGLang builds the indexer's weights_proj without a quant config and the router as a bare parameter."""
    unquantized = set()
    for file in ("deepseek_v2.py", "dsa_indexer.py"):
        for node in ast.walk(contract.source_tree(file)):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("Linear"):
                kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
                if kw.get("quant_config", "None") == "None":
                    unquantized.add(ast.literal_eval(ast.parse(kw["prefix"]).body[0].value.args[0]))
    assert unquantized == {"wk_weights_proj", "weights_proj"}  # wk_weights_proj: wk is dequantized into it
    assert {m.rsplit(".", 1)[1] for m in ENGINE_UNQUANTIZED} == {"weights_proj", "gate"}
    gate = next(n for n in contract.source_tree("deepseek_v2.py").body if isinstance(n, ast.ClassDef)
                and n.name == "MoEGate")
    assert [ast.unparse(b) for b in gate.bases] == ["nn.Module"] and "nn.Parameter" in ast.unparse(gate)


def test_every_key_sglang_reads_is_handled():
    tree = contract.source_tree("fp8.py")
    fn = next(n for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "Fp8Config" for n in c.body
              if isinstance(n, ast.FunctionDef) and n.name == "from_config")
    keys = {e.value for call in ast.walk(fn) if isinstance(call, ast.Call) and ast.unparse(call.func).startswith(
        "cls.get_from_keys") for e in call.args[1].elts}
    handled = {"quant_method", "activation_scheme", "modules_to_not_convert", "ignored_layers", "weight_block_size",
               "scale_fmt"}
    not_weights = {"packed_modules_mapping", "kv_cache_quant_algo"}  # layout hints and the KV cache, not weights
    assert keys == handled | not_weights


def test_ue8m0_scales_are_powers_of_two_and_match_a_loop():
    w = torch.randn(40, 24, generator=torch.Generator().manual_seed(3)) * 0.05
    q, s = quantize_blocks(w, (16, 16), ue8m0=True)
    for r in range(s.shape[0]):
        for c in range(s.shape[1]):
            blk = w[r * 16:(r + 1) * 16, c * 16:(c + 1) * 16]
            want = 2.0 ** torch.ceil(torch.log2(blk.abs().max() / FP8_MAX))
            assert float(s[r, c]) == float(want)
            back = q[r * 16:(r + 1) * 16, c * 16:(c + 1) * 16].float() * s[r, c]
            assert float((back - blk).abs().max()) <= float(blk.abs().max()) * 2.0 ** -3


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
    ({"quant_method": "compressed-tensors", "weight_block_size": [128, 128]}, "quant_method"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "activation_scheme"),
])
def test_unsupported_quantization_configs_are_refused(qc, match):
    with pytest.raises(ValueError, match=match):
        Fp8Scheme.from_quantization_config(qc)


def test_partly_skipped_fused_linears_are_refused_as_sglang_refuses_them():
    qc = dict(GLM5_FP8, modules_to_not_convert=["model.layers.0.mlp.shared_experts.gate_proj"])
    name = "model.layers.0.mlp.shared_experts.up_proj.weight"
    with pytest.raises(ValueError, match="some but not all"):
        sglang_skips("model.layers.0.mlp.shared_experts.gate_up_proj", sglang_reads(qc)["ignored_layers"])
    with pytest.raises(ValueError, match="some but not all"):
        Fp8Scheme.from_quantization_config(qc).quantizes(name, (16, 32))


def test_engine_scheme_reads_the_served_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa", "quantization_config": GLM5_FP8}))
    assert engine_scheme({"model_path": str(tmp_path)}) == Fp8Scheme.from_quantization_config(GLM5_FP8)
    with pytest.raises(ValueError, match="model_path"):
        engine_scheme({"model_path": str(tmp_path / "elsewhere")})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa"}))
    with pytest.raises(ValueError, match="unquantized"):
        engine_scheme({"model_path": str(tmp_path)})
