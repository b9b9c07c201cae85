"""Reading HF ``config.json`` dicts in both hub (transformers 4) and transformers-5 styles.

Hub files say ``num_experts`` / ``rope_theta`` / ``partial_rotary_factor`` at
top level; transformers 5 writes ``num_local_experts`` and a ``rope_parameters``
dict. Each family's translator reads through :class:`HfConfigView` so both
spellings give the same ModelConfig, and an unsupported setting is one clear
error naming the key.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from sao_megatron.config.schema import ModelConfig
from sao_megatron.models import arch
from sao_megatron.models.families.base import ConversionError

_MISSING = object()
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


class HfConfigView:
    """Typed access to an HF config dict with aliases and defaults."""

    def __init__(self, hf: dict[str, Any], source: str):
        self.hf = hf
        self.source = source

    def get(self, *keys: str, default: Any = _MISSING) -> Any:
        """First present key among ``keys`` (aliases), else ``default`` (required when not given)."""
        for key in keys:
            if key in self.hf and self.hf[key] is not None:
                return self.hf[key]
        if default is _MISSING:
            raise ConversionError(f"{self.source}: config.json lacks '{keys[0]}'")
        return default

    def require(self, ok: bool, what: str) -> None:
        if not ok:
            raise ConversionError(f"{self.source}: {what} is not supported yet")

    def rope(self, default_partial: float = 1.0) -> tuple[float, float]:
        """(rope_theta, partial_rotary_factor); rejects rope scaling (yarn, linear, ...)."""
        params = self.hf.get("rope_parameters") or {}
        scaling = self.hf.get("rope_scaling") or {}
        rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        self.require(rope_type == "default", f"rope type '{rope_type}' (rope_scaling/rope_parameters)")
        theta = params.get("rope_theta", self.hf.get("rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", self.hf.get("partial_rotary_factor", default_partial))
        return float(theta), float(partial)

    def rope_base(self, default_partial: float = 1.0) -> tuple[int, float]:
        theta, partial = self.rope(default_partial)
        self.require(float(theta).is_integer(), f"non-integer rope_theta={theta}")
        return int(theta), partial

    def params_dtype(self) -> str:
        name = str(self.get("torch_dtype", "dtype", default="float32")).removeprefix("torch.")
        if name not in DTYPES:
            raise ConversionError(f"{self.source}: dtype '{name}' is not supported (float32, bfloat16, float16)")
        return DTYPES[name]

    def common_checks(self) -> None:
        act = self.get("hidden_act", default="silu")
        self.require(act == "silu", f"hidden_act='{act}' (only silu/SwiGLU)")


def common_model_fields(c: HfConfigView) -> dict[str, Any]:
    """ModelConfig fields read the same way by every supported family."""
    c.common_checks()
    hidden, heads = c.get("hidden_size"), c.get("num_attention_heads")
    head_dim = c.get("head_dim", default=hidden // heads)
    return dict(
        num_layers=c.get("num_hidden_layers"), hidden_size=hidden, ffn_hidden_size=c.get("intermediate_size"),
        num_attention_heads=heads, num_query_groups=c.get("num_key_value_heads", default=heads),
        kv_channels=None if head_dim == hidden // heads else head_dim,
        moe_ffn_hidden_size=c.get("moe_intermediate_size"), moe_router_topk=c.get("num_experts_per_tok"),
        layernorm_epsilon=float(c.get("rms_norm_eps", default=1e-6)), vocab_size=c.get("vocab_size"),
        max_position_embeddings=c.get("max_position_embeddings", default=32768),
        untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", default=False),
        init_method_std=float(c.get("initializer_range", default=0.02)), params_dtype=c.params_dtype(),
    )


def common_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """Hub-style config.json keys shared by the families (read by transformers 4 and 5 and SGLang)."""
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": arch.head_dim(cfg), "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.layernorm_epsilon,
        "rope_theta": float(cfg.rotary_base), "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "initializer_range": cfg.init_method_std, "moe_intermediate_size": cfg.moe_ffn_hidden_size,
        "num_experts_per_tok": cfg.moe_router_topk, "torch_dtype": dtype_name(cfg.params_dtype),
        "use_cache": True,
    }


def check_expressible(cfg: ModelConfig, family: str, **expected: Any) -> None:
    """ConversionError naming the first ModelConfig field the HF family cannot express."""
    for key, want in expected.items():
        have = getattr(cfg, key)
        if have != want:
            raise ConversionError(f"model.{key}={have!r} cannot be expressed as an HF {family} model "
                                  f"(needs {want!r})")


def read_hf_config(hf_dir: str | pathlib.Path) -> dict[str, Any]:
    """Parse ``hf_dir/config.json`` (ConversionError if missing or not JSON)."""
    path = pathlib.Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{path}: not found; --hf-dir must be a Hugging Face model directory")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object")
    return data


def dtype_name(params_dtype: str) -> str:
    """ModelConfig.params_dtype -> HF dtype string."""
    return {v: k for k, v in DTYPES.items()}[params_dtype]
