"""Typed configs, strict YAML loading, overrides and validation."""

from __future__ import annotations

import copy
import pathlib

from sao_megatron.config.loader import (
    ConfigError, Sources, apply_overrides, deep_merge, dump_yaml, from_dict, load_yaml_tree,
    load_yaml_with_origins, to_dict,
)
from sao_megatron.config.schema import (
    ActorConfig, AlgorithmConfig, CheckpointConfig, CriticConfig, DataConfig, ExperimentConfig,
    LoggingConfig, ModelConfig, OptimizerConfig, ParallelConfig, ResourcesConfig, RewardPhase, RolloutConfig,
    RunConfig, SchedulerConfig, WeightSyncConfig,
)
from sao_megatron.config.validate import validate

__all__ = [
    "ActorConfig", "AlgorithmConfig", "CheckpointConfig", "ConfigError", "CriticConfig", "DataConfig",
    "ExperimentConfig", "LoggingConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig",
    "ResourcesConfig", "RewardPhase", "RolloutConfig", "RunConfig", "SchedulerConfig", "Sources",
    "WeightSyncConfig", "apply_overrides", "deep_merge", "dump_yaml", "from_dict", "load_config", "load_yaml_tree",
    "load_yaml_with_origins", "to_dict", "validate", "write_resolved",
]


def load_config(path: str | pathlib.Path, overrides: list[str] | None = None, *,
                world_size: int | None = None, check: bool = True) -> ExperimentConfig:
    """Load an experiment YAML (with ``_base_`` includes), apply ``--set`` overrides, type-check, validate."""
    tree, origins = load_yaml_with_origins(path)
    tree = apply_overrides(tree, overrides or [], origins)
    source = str(path) + (f" (with --set {' '.join(overrides)})" if overrides else "")
    top = str(pathlib.Path(path).resolve())
    cfg = from_dict(ExperimentConfig, tree, source=Sources(str(path), origins, top=top))
    if check:
        validate(cfg, world_size=world_size, source=source)
    return cfg


def write_resolved(cfg: ExperimentConfig, run_dir: str | pathlib.Path, *,
                   scheduler_mode: str | None = None) -> pathlib.Path:
    """Write the fully resolved config into the run directory (``config.yaml``).

    ``scheduler_mode``: ``scheduler.mode`` as resolved at build time (``auto`` -> single/group),
    recorded in the written copy; ``cfg`` itself is not changed."""
    out = pathlib.Path(run_dir) / "config.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    if scheduler_mode is not None:
        cfg = copy.deepcopy(cfg)
        cfg.scheduler.mode = scheduler_mode
    dump_yaml(cfg, out)
    return out
