"""Exported DSA configs (GLM-5, DeepSeek-V3.2) say the indexer's rope style the way SGLang reads it.

Reference: the expression SGLang 0.5.23 evaluates on the config (``srt/models/deepseek_v2.py``,
``is_neox_style = not getattr(config, "indexer_rope_interleave", False)``), read from the pinned
wheel with ``ast``: key and default come from the wheel, not from this test.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

from sao_megatron.models.families import hf_config_from_model, model_config_from_hf
from sao_megatron.rollout import contract

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "component" / "convert_scripts"))
from mla_fixtures import SHAPES  # noqa: E402

pytestmark = pytest.mark.unit


def sglang_indexer_is_neox(hf_config: dict) -> bool:
    """SGLang's own ``is_neox_style`` expression for the indexer, evaluated on an exported config."""
    found = [n.value for n in ast.walk(contract.source_tree("deepseek_v2.py"))
             if isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == ["is_neox_style"]
             and "indexer" in ast.unparse(n.value)]
    assert len(found) == 1, found
    config = type("Config", (), dict(hf_config))()
    return eval(compile(ast.Expression(found[0]), "<sglang deepseek_v2.py>", "eval"), {"config": config})  # noqa: S307


@pytest.mark.parametrize("shape", ["glm5_full_idx", "glm5_shared_idx_mtp", "dsv32"])
def test_exported_indexer_rope_style_is_the_one_sglang_runs(shape):
    hf = SHAPES.get(shape) or {**SHAPES["glm5_full_idx"], "architectures": ["DeepseekV32ForCausalLM"],
                               "model_type": "deepseek_v32", "indexer_types": None}
    cfg = model_config_from_hf(hf)
    exported = hf_config_from_model(cfg)
    # Megatron rotates the indexer's rope part in interleaved pairs iff dsa_indexer_rope_interleaved.
    assert sglang_indexer_is_neox(exported) == (not cfg.dsa_indexer_rope_interleaved)
    assert model_config_from_hf(exported).dsa_indexer_rope_interleaved == cfg.dsa_indexer_rope_interleaved
