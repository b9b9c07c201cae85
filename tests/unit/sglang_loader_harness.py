"""Run SGLang 0.5.23's own DeepSeek/GLM-5 weight loader (``deepseek_weight_loader.py`` of the pinned wheel) on CPU.

The file imports half of SGLang (CUDA kernels, distributed state). Its SGLang imports are served by
stand-ins while it executes: every name is a falsy do-nothing (``_is_cuda``, ``envs.X.get()``, NVFP4 and
AWQ switches: all off) except the few the loading path calls, which are SGLang's own functions from
the wheel (``block_quant_dequant``, ``FusedMoE.make_expert_params_mapping``) or one-line
equivalents of trivial helpers (``maybe_executor_submit`` runs inline, ``default_weight_loader``
copies). ``do_load_weights`` itself, ``_load_fused_indexer_wk`` and the ``cached_a_proj`` fusion run
unchanged. The model is a stand-in whose parameters are named as SGLang's DeepSeek model names them
and whose weight loaders record what they receive.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
import types
from typing import Any

import torch

from sao_megatron.rollout import contract


class _StubMeta(type):
    """A class standing for any imported SGLang name: falsy, callable, attribute-chaining, usable in annotations."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(name)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return _stub("result")

    def __bool__(cls) -> bool:
        return False


def _stub(name: str) -> type:
    return _StubMeta(name, (), {})


class _StubModule(types.ModuleType):
    def __init__(self, name: str, real: dict[str, Any]):
        super().__init__(name)
        self.__path__: list[str] = []  # a package, so submodules import
        self.__dict__.update(real)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub(name)


def _maybe_executor_submit(*, executor, futures, use_async, func, func_args=(), func_kwargs=None) -> None:
    func(*func_args, **(func_kwargs or {}))


def _default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    param.data.copy_(loaded_weight)


def _real_names() -> dict[str, dict[str, Any]]:
    """Module -> names the loading path calls: SGLang's own code where it is more than a line."""
    dequant = contract.source_function("fp8_utils.py", "block_quant_dequant", {"torch": torch, "List": list})
    mapping = contract.source_function("layer.py", "FusedMoE.make_expert_params_mapping",
                                       {"List": list, "Tuple": tuple})
    fused_moe = type("FusedMoE", (), {"make_expert_params_mapping": classmethod(mapping)})
    return {
        "sglang.srt.layers.quantization.fp8_utils": {"block_quant_dequant": dequant},
        "sglang.srt.layers.moe.fused_moe_triton.layer": {"FusedMoE": fused_moe},
        "sglang.srt.model_loader.utils": {"maybe_executor_submit": _maybe_executor_submit,
                                          "should_async_load": lambda weight: False},
        "sglang.srt.model_loader.weight_utils": {"RUNAI_STREAMER_TENSOR_ATTR": "_sglang_runai_streamer_tensor",
                                                 "default_weight_loader": _default_weight_loader},
        "sglang.srt.layers.utils": {"get_layer_id": lambda name: None},
    }


@functools.cache
def deepseek_loader() -> types.ModuleType:
    """``sglang/srt/models/deepseek_common/deepseek_weight_loader.py`` executed with the stand-ins above."""
    real = _real_names()
    imported = {n.module for n in contract.source_tree("deepseek_weight_loader.py").body
                if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("sglang")}
    packages = {".".join(m.split(".")[:i]) for m in imported for i in range(1, m.count(".") + 2)}
    saved = {name: sys.modules.get(name) for name in packages}
    sys.modules.update({name: _StubModule(name, real.get(name, {})) for name in packages})
    try:
        path = contract.contract_dir() / "deepseek_weight_loader.py"
        spec = importlib.util.spec_from_file_location("sglang_contract_deepseek_weight_loader", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    return module


def sglang_param_name(hf_name: str, *, fused_indexer: bool) -> str | None:
    """The SGLang DeepSeek-model parameter an HF tensor loads into (None: folded into a fused parameter)."""
    for part in ("self_attn.q_a_proj.", "self_attn.kv_a_proj_with_mqa."):
        if part in hf_name:
            return hf_name.replace(part, "self_attn.fused_qkv_a_proj_with_mqa.")
    if fused_indexer and (".indexer.wk." in hf_name or ".indexer.weights_proj." in hf_name):
        return None
    if ".mlp.experts." in hf_name:
        layer, rest = hf_name.split(".mlp.experts.", 1)
        proj = rest.split(".", 2)[1]
        return f"{layer}.mlp.experts.{'w2_' if proj == 'down_proj' else 'w13_'}{rest.split('.', 2)[2]}"
    return hf_name.replace(".gate_proj.", ".gate_up_proj.").replace(".up_proj.", ".gate_up_proj.")


class Recorder:
    """A parameter's weight_loader that records each call (parameter name, tensor, shard/expert ids)."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __call__(self, param, loaded, *args, **kwargs) -> None:
        ids = tuple(a for a in args if not isinstance(a, str) or a != self.name) + tuple(sorted(kwargs.items()))
        self.log.append((self.name, ids, loaded.detach().clone()))


def build_model(hf: dict[str, torch.Tensor], config: dict[str, Any], *, fused_indexer: bool,
                index_head_dim: int = 0, index_n_heads: int = 0, block: tuple[int, int] = (128, 128)):
    """A stand-in DeepSeek model carrying SGLang's weight-loader mixin; ``.log`` records every load."""
    mixin = deepseek_loader().DeepseekV2WeightLoaderMixin
    log: list = []
    params: dict[str, torch.nn.Parameter] = {}
    for name in hf:
        target = sglang_param_name(name, fused_indexer=fused_indexer)
        if target is not None and target not in params:
            params[target] = torch.nn.Parameter(torch.empty(0), requires_grad=False)
            params[target].weight_loader = Recorder(target, log)
        if target is None:  # the fused bf16 indexer projection: wk rows on top, weights_proj rows below
            fused = name.rsplit(".indexer.", 1)[0] + ".indexer.wk_weights_proj.weight"
            hidden = hf[name].shape[1]
            params.setdefault(fused, torch.nn.Parameter(
                torch.full((index_head_dim + index_n_heads, hidden), float("nan"), dtype=torch.bfloat16),
                requires_grad=False))

    class Model(mixin):
        def __init__(self):
            self.config = types.SimpleNamespace(**config)
            self.quant_config = types.SimpleNamespace(weight_block_size=list(block), get_name=lambda: "fp8")
            self.num_fused_shared_experts = 0
            self.pp_group = types.SimpleNamespace(is_last_rank=True)
            self.model = types.SimpleNamespace()
            self.log = log
            self.post_loads: list[list[str]] = []

        def load_weights(self, weights, is_nextn=False):  # DeepseekV2ForCausalLM.load_weights delegates so
            self.do_load_weights(weights, is_nextn)

        def named_parameters(self):
            return params.items()

        def post_load_weights(self, is_nextn=False, weight_names=None):  # kv_b_proj -> w_kc/w_vc: not modelled
            self.post_loads.append(list(weight_names or []))

    model = Model()
    model.params = params
    return model
