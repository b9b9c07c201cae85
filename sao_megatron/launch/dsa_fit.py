"""The planner's refusal when DeepSeek sparse attention's memory is what does not fit.

megatron's unfused DSA path (``dsa_kernel_backend: none``) is quadratic in the sequence
(``models.mla_sizes.dsa_attention_bytes``); at GLM-5's 16k tokens its fp32 scores alone exceed an
H200. The planner's memory estimate includes it; this module turns "does not fit" into a message
naming the backend, the sizes and the two ways out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from sao_megatron.config.schema import ExperimentConfig
from sao_megatron.models import mla_sizes

GIB = 2**30
PeakFn = Callable[..., tuple]
"""``planner.trainer_peak_gib`` (passed in: the planner imports this module)."""


def dsa_fit_errors(cfg: ExperimentConfig, lay, peak_gib: float, budget_gib: float, *, peak: PeakFn) -> list[str]:
    """A clear refusal when the unfused DSA path is what does not fit (the same plan with a fused
    backend would): the backend, the sequence, the sizes, and the two ways out (a fused backend, or
    the longest sequence that fits unfused)."""
    m = cfg.model
    if (m.experimental_attention_variant != "dsa" or peak_gib <= budget_gib
            or m.dsa_kernel_backend in mla_sizes.FUSED_DSA_BACKENDS):
        return []
    fused = dataclasses.replace(cfg, model=dataclasses.replace(m, dsa_kernel_backend="tilelang"))
    if peak(fused, lay)[0] > budget_gib:
        return []  # it would not fit with fused kernels either: the generic memory verdict says why
    seq = cfg.data.max_total_tokens
    tokens = max(cfg.actor.max_tokens_per_microbatch, cfg.critic.max_tokens_per_microbatch)
    _, transient = mla_sizes.dsa_attention_bytes(m, tp=lay.tp, seq=min(seq, tokens), batch=max(tokens // seq, 1))
    fits = _longest_fitting_sequence(cfg, lay, budget_gib, peak)
    way = (f"cap data.max_total_tokens at {fits}" if fits else "no sequence length fits this layout")
    return [f"model.dsa_kernel_backend={m.dsa_kernel_backend} at data.max_total_tokens={seq}: DSA attention needs "
            f"{transient / GIB:.1f} GiB per GPU for one layer (unfused: fp32 s x b x {m.dsa_indexer_n_heads} "
            f"indexer heads x s scores, twice during ReLU/weighting, then b x {m.num_attention_heads // lay.tp} "
            f"heads x s x s); "
            f"the trainer would need {peak_gib:.1f} of {budget_gib:.1f} GiB. Set model.dsa_kernel_backend=tilelang "
            f"(CUDA + tilelang, prepared by scripts/gpu_wheels.sh), or {way} with the unfused path"]


def _longest_fitting_sequence(cfg: ExperimentConfig, lay, budget_gib: float, peak: PeakFn) -> int | None:
    """The longest power-of-two sequence (>= 1024) whose trainer peak fits, or None."""
    best, seq = None, 1024
    while seq < cfg.data.max_total_tokens:
        trial = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_total_tokens=seq))
        if peak(trial, lay)[0] > budget_gib:
            break
        best, seq = seq, seq * 2
    return best
