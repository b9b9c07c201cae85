"""The adapter from the config to the objectives table: ``algorithm.<section>`` -> the keyword
arguments of that section's function in ``algorithms.objectives`` (the maths takes plain numbers,
never config objects). One entry per section; a new estimator or loss adds one here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sao_megatron.algorithms.advantages import RunningMeanBaseline
from sao_megatron.config import AlgorithmConfig
from sao_megatron.config.schema import DisConfig, GaeConfig, GroupAdvantageConfig, PpoClipConfig


def _gae(alg: AlgorithmConfig, baseline: RunningMeanBaseline | None) -> dict[str, Any]:
    c: GaeConfig = alg.gae
    return {"gamma": c.gamma, "lam": c.lam, "skip_observations": c.skip_observations}


def _group(alg: AlgorithmConfig, baseline: RunningMeanBaseline | None) -> dict[str, Any]:
    c: GroupAdvantageConfig = alg.group
    return {"normalize_std": c.normalize_std}


def _running_mean(alg: AlgorithmConfig, baseline: RunningMeanBaseline | None) -> dict[str, Any]:
    # alg.running_mean.momentum shaped the baseline when it was built (build_baseline); each batch passes its state.
    assert baseline is not None, "the running-mean objective needs its baseline (components.build_baseline)"
    return {"baseline": baseline}


def _dis(alg: AlgorithmConfig, baseline: RunningMeanBaseline | None) -> dict[str, Any]:
    c: DisConfig = alg.dis
    return {"eps_low": c.eps_low, "eps_high": c.eps_high}


def _ppo_clip(alg: AlgorithmConfig, baseline: RunningMeanBaseline | None) -> dict[str, Any]:
    c: PpoClipConfig = alg.ppo_clip
    return {"clip_low": c.clip_low, "clip_high": c.clip_high, "dual_clip": c.dual_clip}


_KNOBS: dict[str, Callable[[AlgorithmConfig, RunningMeanBaseline | None], dict[str, Any]]] = {
    "gae": _gae, "group": _group, "running_mean": _running_mean, "dis": _dis, "ppo_clip": _ppo_clip}


def knobs(alg: AlgorithmConfig, section: str, *, baseline: RunningMeanBaseline | None = None) -> dict[str, Any]:
    """The keyword arguments ``algorithm.<section>`` gives its function (``baseline``: the running-mean
    estimator's state, built once by ``components.build_baseline``)."""
    return _KNOBS[section](alg, baseline)

