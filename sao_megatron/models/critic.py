"""Critic: the actor's trunk with a scalar value head, initialised from the actor, frozen attention.

The value head replaces GPTModel's ``output_layer`` so one ordinary forward
returns per-position values [b, s, 1] (through GPTModel's own post-processing,
pipeline schedules and checkpointing). ``token_values`` aligns them with the
tokens exactly like the actor's log-probs: ``values[:, t]`` is the critic's
output at the position that predicts ``y_t`` (docs/architecture.md#values).

Parameter groups (``CriticConfig.trainable``) are recognised from Megatron
parameter names, for both the local and the Transformer Engine specs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from sao_megatron.models.arch import PARAM_GROUPS

logger = logging.getLogger(__name__)

# (substring, group), first match wins. Fused TE norms ("linear_qkv.layer_norm_weight",
# "linear_fc1.layer_norm_weight") are norms, not attention/MLP weights; q/k norms are attention
# (docs/architecture.md#critic: frozen attention covers QKV, output projection and q/k norms).
_GROUP_RULES = (
    (".layer_norm_", "norms"),
    ("input_layernorm.", "norms"),
    ("pre_mlp_layernorm.", "norms"),
    ("final_layernorm.", "norms"),
    (".mlp.experts.", "routed_experts"),
    (".mlp.shared_experts.", "shared_experts"),
    (".mlp.router.", "router"),
    (".self_attention.", "attention"),
    ("embedding.", "embedding"),
    (".mlp.linear_fc", "dense_mlp"),
)


def param_group(name: str, *, is_value_head: bool = False) -> str:
    """Group of a parameter from its name (``module.`` prefixes of wrappers are ignored)."""
    if "output_layer." in name:
        return "value_head" if is_value_head else "lm_head"
    for pattern, group in _GROUP_RULES:
        if pattern in "." + name:
            return group
    raise ValueError(f"parameter {name!r} matches no critic parameter group; extend _GROUP_RULES in {__name__}")


class ValueHead(torch.nn.Module):
    """Linear hidden -> 1 used in place of GPTModel.output_layer.

    Called like the LM head, ``(hidden_states [s(/tp), b, h]) -> (values [s, b, 1], None)``.
    Under sequence parallelism the hidden states are sequence shards: the head runs on the
    shard and the values are all-gathered. The weight is replicated over TP; each rank's
    gradient covers its shard only, so it is tagged ``sequence_parallel`` to be summed over TP.
    """

    def __init__(self, hidden_size: int, *, sequence_parallel: bool, tp_group: dist.ProcessGroup | None,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        # Zero init: identical on every rank without coordinating RNGs, values start at 0.
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group
        for p in (self.weight, self.bias):
            p.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        values = torch.nn.functional.linear(hidden_states, self.weight, self.bias)
        if self.sequence_parallel:
            # The loss is replicated over TP ranks: backward takes this rank's slice (no reduce).
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)
        return values, None


def attach_value_head(gpt: torch.nn.Module, *, tp_group: dist.ProcessGroup | None) -> ValueHead:
    """Replace the LM head of a last-stage GPTModel by a ValueHead (the model's forward then gives values)."""
    from sao_megatron.models.specs import init_device

    # On the model's device: a head left on the CPU of a GPU node breaks the first forward
    # (plain optimizer, or a frozen head that no optimizer buffer ever moves).
    head = ValueHead(gpt.config.hidden_size, sequence_parallel=gpt.config.sequence_parallel, tp_group=tp_group,
                     dtype=gpt.config.params_dtype, device=init_device(gpt.config))
    gpt.output_layer = head
    return head


def is_critic(chunk: torch.nn.Module) -> bool:
    return any(isinstance(m, ValueHead) for m in chunk.modules())


def token_values(values_bs1: torch.Tensor) -> torch.Tensor:
    """[b, s, 1] head outputs -> [b, s] values aligned with tokens: ``out[:, t] = head[:, t-1]``, column 0 = 0."""
    v = values_bs1.squeeze(-1).float()
    return torch.cat([v.new_zeros(v.shape[0], 1), v[:, :-1]], dim=1)


def _check_groups(groups: Iterable[str]) -> set[str]:
    groups = set(groups)
    unknown = groups - set(PARAM_GROUPS) - {"all"}
    if unknown:
        raise ValueError(f"critic.trainable has unknown group(s) {sorted(unknown)}; valid groups: "
                         f"{', '.join(PARAM_GROUPS)}, all")
    return set(PARAM_GROUPS) if "all" in groups else groups


def freeze_for_critic(chunks: Sequence[torch.nn.Module], trainable_groups: Iterable[str]) -> dict[str, int]:
    """Set ``requires_grad`` by group (call BEFORE wrapping in DDP: frozen params then get no grad
    buffer and no optimizer state). Returns local element counts: trainable, frozen and per group.
    """
    trainable = _check_groups(trainable_groups)
    counts: dict[str, int] = {"trainable": 0, "frozen": 0}
    for chunk in chunks:
        critic = is_critic(chunk)
        for name, param in chunk.named_parameters():
            group = param_group(name, is_value_head=critic)
            param.requires_grad_(group in trainable)
            counts["trainable" if group in trainable else "frozen"] += param.numel()
            counts[group] = counts.get(group, 0) + param.numel()
    if counts["trainable"] == 0:
        logger.warning("critic: no trainable parameters on this rank for groups %s", sorted(trainable))
    return counts


def init_critic_from_actor(critic_chunks: Sequence[torch.nn.Module], actor_chunks: Sequence[torch.nn.Module]) -> None:
    """Copy every trunk parameter and buffer of the actor (same layout) into the critic; the head stays."""
    if len(critic_chunks) != len(actor_chunks):
        raise ValueError(f"critic has {len(critic_chunks)} model chunks, actor {len(actor_chunks)}: "
                         "build both with the same parallel layout")
    for critic, actor in zip(critic_chunks, actor_chunks):
        trunk = {k: v for k, v in actor.state_dict().items() if not k.startswith("output_layer.")}
        missing, unexpected = critic.load_state_dict(trunk, strict=False)
        missing = [k for k in missing if not k.startswith("output_layer.")]
        if missing or unexpected:
            raise ValueError(f"actor and critic trunks differ (missing {missing[:5]}, unexpected {unexpected[:5]}): "
                             "build both from the same ModelConfig and layout")
