"""Loader-aware buckets (``rollout/loader_groups.py``) against SGLang 0.5.23's own loaders.

References: the loaders' source from the pinned wheel (read with ``ast``: which state a
``load_weights`` call keeps between tensors, and for which names), SGLang's own DeepSeek/GLM-5
loader run on the buckets (``sglang_loader_harness``) compared with the same loader given every
tensor in one call (what ``/update_weights_from_disk`` does), SGLang's ``FlattenedTensorBucket`` as
the receiving end, and a slow list-based bucket planner.
"""

from __future__ import annotations

import ast
import pathlib
import random
import sys

import pytest
import torch

from sao_megatron.models.families import get_family, model_config_from_hf
from sao_megatron.rollout import contract
from sao_megatron.weights.fp8_block import Fp8Scheme, requantize
from sao_megatron.rollout.loader_groups import (
    A_PROJ, ANY_FAMILY, FAMILY_GROUPS, INDEXER_WEIGHTS_PROJ, INDEXER_WK, KV_B_PROJ, group_key, plan_buckets)
from sao_megatron.rollout.update_group import flatten_bucket
from sao_megatron.weights.distributed import _buckets

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "component" / "convert_scripts"))
from mla_fixtures import SHAPES  # noqa: E402

import sglang_loader_harness as harness  # noqa: E402

pytestmark = pytest.mark.unit

# Our family -> (file, class) of the SGLang model that serves it.
SGLANG_CLASSES = {"qwen3_moe": ("qwen3_moe.py", "Qwen3MoeForCausalLM"), "glm4_moe": ("glm4_moe.py", "Glm4MoeForCausalLM"),
                  "deepseek_v3": ("deepseek_v2.py", "DeepseekV3ForCausalLM"),
                  "deepseek_v32": ("deepseek_v2.py", "DeepseekV32ForCausalLM"),
                  "glm_moe_dsa": ("glm4_moe.py", "GlmMoeDsaForCausalLM")}
# Call-scoped state of a loader -> the groups that exist because of it.
STATE_GROUPS = {"cached_a_proj": {A_PROJ}, "pending_indexer_wk": {INDEXER_WK, INDEXER_WEIGHTS_PROJ}}
MIXIN = ("deepseek_weight_loader.py", "DeepseekV2WeightLoaderMixin")


def _classes() -> dict[str, tuple[str, ast.ClassDef]]:
    files = ("qwen3_moe.py", "glm4_moe.py", "deepseek_v2.py", "deepseek_weight_loader.py")
    return {n.name: (f, n) for f in files for n in contract.source_tree(f).body if isinstance(n, ast.ClassDef)}


def _method(cls: str, name: str) -> ast.FunctionDef:
    """``cls.name`` as SGLang resolves it (bases followed within the loader files)."""
    classes = _classes()
    todo = [cls]
    while todo:
        _, node = classes[todo.pop(0)]
        found = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
        if found is not None:
            return found
        todo += [b.id for b in node.bases if isinstance(b, ast.Name) and b.id in classes]
    raise KeyError(f"{cls}.{name}")


def _loader(family: str) -> ast.FunctionDef:
    """The function that loads one call's tensors (``load_weights``, or what it delegates to)."""
    fn = _method(SGLANG_CLASSES[family][1], "load_weights")
    calls = [n.func.attr for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and isinstance(n.func.value, ast.Name) and n.func.value.id == "self"]
    return _method(SGLANG_CLASSES[family][1], "do_load_weights") if calls == ["do_load_weights"] else fn


def _call_scoped_state(fn: ast.FunctionDef) -> set[str]:
    """Locals created as an empty dict in the function: state that lives for one call."""
    def empty_dict(v: ast.expr) -> bool:
        if isinstance(v, ast.IfExp):
            return empty_dict(v.body) or empty_dict(v.orelse)
        func = ast.unparse(v.func) if isinstance(v, ast.Call) else ""
        return (isinstance(v, ast.Dict) and not v.keys) or (func == "dict" and not v.args and not v.keywords) or (
            func.endswith("defaultdict") and len(v.args) <= 1)
    names = set()
    for node in ast.walk(fn):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and empty_dict(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _strings(fn: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(fn) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


@pytest.mark.parametrize("family", sorted(SGLANG_CLASSES))
def test_table_lists_the_groups_that_sglangs_loader_keeps_per_call(family):
    """A new per-call cache in any loader, or one removed, fails here: the table must be re-read."""
    assert set(FAMILY_GROUPS) == set(SGLANG_CLASSES)
    state = _call_scoped_state(_loader(family))
    assert state <= set(STATE_GROUPS), f"{family}: SGLang's loader keeps {state - set(STATE_GROUPS)} per call"
    wanted = set().union(*(STATE_GROUPS[s] for s in state))
    try:  # after each call, derived weights are rebuilt from the call's kv_b_proj tensors
        post = _method(SGLANG_CLASSES[family][1], "post_load_weights")
    except KeyError:
        post = None
    if post is not None and "kv_b_proj" in _strings(post):
        wanted.add(KV_B_PROJ)
    ours = set(FAMILY_GROUPS[family])
    if family == "deepseek_v3":  # the same loader; DeepSeek-V3 has no indexer tensors to pair
        ours |= {INDEXER_WK, INDEXER_WEIGHTS_PROJ}
    assert ours == wanted


def test_group_members_are_the_names_sglangs_deepseek_loader_pairs():
    strings = _strings(_method(MIXIN[1], "do_load_weights"))
    assert {"q_a_proj", "kv_a_proj_with_mqa", "fused_qkv_a_proj_with_mqa"} <= strings
    assert {".indexer.wk.", ".indexer.weights_proj."} <= strings
    helper = next(n for n in contract.source_tree(MIXIN[0]).body
                  if isinstance(n, ast.FunctionDef) and n.name == "_load_fused_indexer_wk")
    assert {".weight_scale_inv", ".indexer.weights_proj.", ".indexer.wk_weights_proj.weight"} <= _strings(helper)
    post = _method(MIXIN[1], "post_load_weights")
    assert "kv_b_proj" in _strings(post) and "weight_scale_inv" in ast.unparse(post)
    for group, needle in ((A_PROJ, "q_a_proj"), (A_PROJ, "kv_a_proj_with_mqa"), (INDEXER_WK, ".indexer.wk."),
                          (INDEXER_WEIGHTS_PROJ, ".indexer.weights_proj."), (KV_B_PROJ, "kv_b_proj")):
        assert any(needle.strip(".") in w for w in group.weights)


def _hf_tensors(shape: str, scheme: Fp8Scheme | None, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    cfg = model_config_from_hf(SHAPES[shape])
    gen = torch.Generator().manual_seed(seed)
    named = [(n, torch.randn(s, generator=gen) * 0.1) for n, s in get_family(cfg.family).weight_map(cfg).hf_shapes().items()]
    return list(requantize(named, scheme)) if scheme else named


def _through_sglang_receiver(bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The bucket as SGLang's FlattenedTensorBucket rebuilds it from the broadcast bytes."""
    cls = contract.tensor_bucket().FlattenedTensorBucket
    received = cls.empty([n for n, _ in bucket], [t.dtype for _, t in bucket], [list(t.shape) for _, t in bucket], "cpu")
    received.get_flattened_tensor().copy_(flatten_bucket([t for _, t in bucket]))
    return received.reconstruct_tensors()


def _loads(model) -> list[tuple[str, str, torch.Tensor]]:
    return sorted(((n, str(ids), t) for n, ids, t in model.log), key=lambda x: x[:2])


GLM5_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16],
            "modules_to_not_convert": ["lm_head", "model.embed_tokens"]
            + [f"model.layers.{i}.self_attn.indexer.weights_proj" for i in range(4)]}


@pytest.mark.parametrize("shape,quant,fused_indexer", [
    ("dsv3_rope_shared2", GLM5_FP8, False), ("glm5_full_idx", GLM5_FP8, True), ("glm5_full_idx", None, True)])
def test_sglangs_own_loader_gets_every_tensor_from_our_buckets(shape, quant, fused_indexer):
    """Bucket by bucket, SGLang's DeepSeek loader must do what it does with all tensors in one call."""
    scheme = Fp8Scheme.from_quantization_config(quant) if quant else None
    named = _hf_tensors(shape, scheme)
    hf = SHAPES[shape]
    kwargs = dict(fused_indexer=fused_indexer, index_head_dim=hf.get("index_head_dim", 0),
                  index_n_heads=hf.get("index_n_heads", 0), block=(16, 16))
    reference = harness.build_model(dict(named), hf, **kwargs)
    reference.load_weights(named)
    total = sum(t.numel() * t.element_size() for _, t in named)
    assert any("fused_qkv_a_proj_with_mqa" in n for n, _, _ in reference.log)
    for cap in sorted({total // k for k in (40, 17, 9, 5, 2)} | {1500, 2600, 3100}):
        model = harness.build_model(dict(named), hf, **kwargs)
        for bucket in _buckets(named, cap):
            model.load_weights(_through_sglang_receiver(bucket))
        got, want = _loads(model), _loads(reference)
        assert [x[:2] for x in got] == [x[:2] for x in want], f"bucket_bytes={cap}"
        assert all(torch.equal(a[2], b[2]) for a, b in zip(got, want)), f"bucket_bytes={cap}"
        for name, param in reference.params.items():
            if name.endswith("wk_weights_proj.weight"):
                assert not param.isnan().any() and torch.equal(model.params[name], param), f"{name}, {cap}"


def _slow_plan(names, nbytes, dtypes, cap, groups) -> list[set[int]]:
    """Units: a group is complete at its last member; each unit goes to its largest member's dtype bucket."""
    members: dict = {}
    for i, n in enumerate(names):
        found = group_key(n, groups)
        members.setdefault(found if found else ("alone", i), []).append(i)
    units = sorted(members.values(), key=max)
    out, pending = [], {}
    for unit in units:
        dtype = dtypes[max(unit, key=lambda i: nbytes[i])]
        items = pending.setdefault(dtype, [])
        if items and sum(nbytes[i] for i in items) + sum(nbytes[i] for i in unit) > cap:
            out.append(set(items))
            items.clear()
        items += unit
    return out + [set(v) for v in pending.values() if v]


def test_plan_buckets_equals_the_slow_plan_and_keeps_every_group_whole():
    rng = random.Random(0)
    base = _hf_tensors("glm5_full_idx", Fp8Scheme.from_quantization_config(GLM5_FP8))
    for trial in range(60):
        named = rng.sample(base, len(base)) if trial % 2 else base
        names = [n for n, _ in named]
        nbytes = [t.numel() * t.element_size() for _, t in named]
        dtypes = [t.dtype for _, t in named]
        cap = rng.randrange(64, 6000)
        plan = plan_buckets(names, nbytes, dtypes, family="glm_moe_dsa", max_bucket_bytes=cap)
        assert sorted(map(sorted, plan)) == sorted(map(sorted, _slow_plan(names, nbytes, dtypes, cap,
                                                                           FAMILY_GROUPS["glm_moe_dsa"])))
        for bucket in plan:
            sizes = [dtypes[i].itemsize for i in bucket]
            assert sizes == sorted(sizes, reverse=True)  # aligned when flattened
            if len(bucket) > 1 and sum(nbytes[i] for i in bucket) > cap:
                assert len({group_key(names[i], ANY_FAMILY) for i in bucket}) == 1  # one oversized group


@pytest.mark.parametrize("family_shape", ["dsv3_rope_shared2", "glm5_full_idx"])
def test_any_family_table_groups_each_family_as_its_own_table(family_shape):
    cfg = model_config_from_hf(SHAPES[family_shape])
    names = list(get_family(cfg.family).weight_map(cfg).hf_shapes())
    names += [n + "_scale_inv" for n in names if n.endswith(".weight")]
    assert [group_key(n, ANY_FAMILY) for n in names] == [group_key(n, FAMILY_GROUPS[cfg.family]) for n in names]
    assert any(group_key(n, ANY_FAMILY) for n in names)
