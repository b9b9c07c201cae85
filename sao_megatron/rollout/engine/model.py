"""The embedded engine's model: a Hugging Face causal LM with per-request KV caches.

Prefill runs one request at a time (no padding anywhere in the query). Decode
runs every running request in one forward: each request's cache is left-padded
to the longest, with an attention mask hiding the padding and explicit position
ids, so a request's logits match a fresh full forward of the same weights
(measured ~1e-6 in fp32, tests hold it to 1e-5).

Routed experts (optional): forward hooks on the MoE routers (``model.layers.N.mlp.gate``, which
returns ``(logits, weights, top-k ids)`` for qwen3_moe, glm4_moe, glm_moe_dsa and deepseek_v3 in
transformers 5) record the top-k expert ids of every token fed through the model, per layer.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from sao_megatron.rollout.engine.kv_cache import KVCache, split_rows, stack_rows

logger = logging.getLogger(__name__)

# config.json keys that do not change the computation (compared configs ignore them).
_CONFIG_METADATA = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache",
                    "output_router_logits", "_attn_implementation", "_commit_hash", "architectures_version"}
_ROUTER_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.gate$")
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class Forward:
    """Result of one forward: next-token logits [B, V] fp32, the updated caches, routing [B, T, L, K] or None."""

    logits_bv: torch.Tensor
    caches: list[KVCache]
    routing: list[np.ndarray] | None


def load_hf_model(model_dir: str | Path) -> torch.nn.Module:
    """An fp32 eval-mode HF causal LM; raises ValueError if weights are missing or unexpected."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} has no config.json: pass a Hugging Face model directory")
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    info["unexpected_keys"] = [k for k in info.get("unexpected_keys") or () if not is_mtp_tensor(k, model.config)]
    problems = {k: sorted(v)[:5] for k, v in info.items() if k != "error_msgs" and v}
    if problems or info.get("error_msgs"):
        raise ValueError(f"weights in {model_dir} do not match the model class: {problems or info['error_msgs']}")
    return model.eval()


def is_mtp_tensor(name: str, config) -> bool:
    """A multi-token-prediction layer's tensor (DeepSeek-V3 / GLM-5 store them as layers >= num_hidden_layers).

    transformers does not build them (an SGLang engine may use them as a speculative draft), so
    they are the checkpoint's only tensors the served model legitimately lacks.
    """
    match = _LAYER_NAME.match(name)
    first = int(config.num_hidden_layers)
    return bool(match) and first <= int(match.group(1)) < first + int(getattr(config, "num_nextn_predict_layers", 0) or 0)


def read_config(model_dir: str | Path) -> dict:
    """config.json without the keys that do not change the computation."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return {k: v for k, v in cfg.items() if k not in _CONFIG_METADATA}


class ModelRunner:
    """Owns the live model; prefill/decode forwards and between-step weight swaps."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = str(model_dir)
        self.config_dict = read_config(model_dir)
        self.model = load_hf_model(model_dir)
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_context = int(getattr(cfg, "max_position_embeddings", 4096))
        self.num_layers = int(cfg.num_hidden_layers)
        self.topk = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
        self.eos_ids = _eos_ids(self.model)
        self._routing: dict[int, torch.Tensor] = {}
        self._record = False
        self._hooks = self._install_router_hooks(self.model)

    # ---------------------------------------------------------------- weights
    def load_checked(self, model_dir: str | Path) -> torch.nn.Module:
        """Load a new checkpoint for a swap; ValueError if its config or tensors differ from the live model's."""
        if not Path(model_dir).is_dir():
            raise ValueError(f"model_path {model_dir} is not a directory")
        new_cfg = read_config(model_dir)
        diff = sorted(k for k in set(new_cfg) | set(self.config_dict) if new_cfg.get(k) != self.config_dict.get(k))
        if diff:
            raise ValueError(f"config.json in {model_dir} differs from the served model in {diff[:8]}: "
                             f"an update must keep the architecture")
        model = load_hf_model(model_dir)
        live = {k: v.shape for k, v in self.model.state_dict().items()}
        new = {k: v.shape for k, v in model.state_dict().items()}
        if live != new:
            raise ValueError(f"tensors in {model_dir} differ from the served model: "
                             f"{sorted(set(live) ^ set(new))[:5] or 'shapes differ'}")
        return model

    def swap(self, model: torch.nn.Module, model_dir: str | Path) -> None:
        """Make ``model`` live (call between forwards only)."""
        for h in self._hooks:
            h.remove()
        self.model = model
        self.model_dir = str(model_dir)
        self._hooks = self._install_router_hooks(model)

    # ---------------------------------------------------------------- routing capture
    def _install_router_hooks(self, model: torch.nn.Module) -> list:
        hooks = []
        for name, module in model.named_modules():
            match = _ROUTER_NAME.match(name)
            if match:
                hooks.append(module.register_forward_hook(self._router_hook(int(match.group(1)))))
        return hooks

    def _router_hook(self, layer: int):
        def hook(_module, _inputs, output):
            if not self._record:
                return
            if isinstance(output, tuple) and len(output) == 3:  # (logits, weights, indices) in transformers 5
                self._routing[layer] = output[2].detach()
            else:  # a router returning logits only
                logits = output[0] if isinstance(output, tuple) else output
                self._routing[layer] = torch.topk(torch.softmax(logits.float(), -1), self.topk, dim=-1).indices
        return hook

    def _collect_routing(self, batch: int, tokens: int) -> list[np.ndarray]:
        """Recorded ids as one [tokens, num_layers, topk] int32 array per batch row.

        Dense layers (no router) read 0, as in SGLang 0.5.23, whose capture buffer starts zeroed and is
        written by MoE layers only (``srt/state_capturer/routed_experts.py``)."""
        out = np.zeros((batch, tokens, self.num_layers, max(self.topk, 1)), dtype=np.int32)
        for layer, ids in self._routing.items():
            out[:, :, layer, : ids.shape[-1]] = ids.reshape(batch, tokens, -1).to(torch.int32).numpy()
        self._routing.clear()
        return list(out)

    # ---------------------------------------------------------------- forwards
    @torch.inference_mode()
    def prefill(self, token_ids: list[int], *, record_routing: bool = False) -> Forward:
        """Feed a whole sequence of one request; logits of its last position."""
        self._record = record_routing
        try:
            out = self.model(input_ids=torch.tensor([token_ids]), use_cache=True)
        finally:
            self._record = False
        routing = self._collect_routing(1, len(token_ids)) if record_routing else None
        return Forward(out.logits[:, -1].float(), split_rows(out.past_key_values, [len(token_ids)]), routing)

    @torch.inference_mode()
    def decode(self, last_tokens: list[int], caches: list[KVCache], *, record_routing: bool = False) -> Forward:
        """One decode step for B requests: feed each one's last token on top of its own cache."""
        past, lengths = stack_rows(caches, self.model.config)
        longest = max(lengths)
        mask = torch.zeros(len(caches), longest + 1, dtype=torch.long)
        for i, n in enumerate(lengths):
            mask[i, longest - n:] = 1
        self._record = record_routing
        try:
            out = self.model(input_ids=torch.tensor(last_tokens).unsqueeze(1), attention_mask=mask,
                             position_ids=torch.tensor(lengths).unsqueeze(1),
                             past_key_values=past, use_cache=True)
        finally:
            self._record = False
        new_caches = split_rows(out.past_key_values, [n + 1 for n in lengths])
        routing = self._collect_routing(len(caches), 1) if record_routing else None
        return Forward(out.logits[:, -1].float(), new_caches, routing)

    @torch.inference_mode()
    def full_logits(self, token_ids: list[int]) -> torch.Tensor:
        """[T, V] fp32 logits of a fresh forward without cache (the parity reference)."""
        return self.model(input_ids=torch.tensor([token_ids])).logits[0].float()


def _eos_ids(model: torch.nn.Module) -> set[int]:
    ids: set[int] = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return ids
