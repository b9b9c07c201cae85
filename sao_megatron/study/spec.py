"""The study file (``configs/studies/*.yaml``) and the plan it expands to.

A study names a base experiment config and a set of *variants*, each a set of ``--set`` overrides
on that base. Every variant x seed is one ``sao-megatron train`` run. All runs train on the same
number of samples (``samples_per_run``): a variant's ``run.num_steps`` is
``samples_per_run / scheduler.batch_size`` of its resolved config, so a B x 8 variant (batch 8B)
takes an eighth of the steps of a B x 1 one. The plan names each variant's shape as
prompts x rollouts per step.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

from sao_megatron.config import ConfigError, ExperimentConfig, load_config
from sao_megatron.config.loader import Sources, from_dict, load_yaml_tree
from sao_megatron.config.validate import resolved_mode

cfg = dataclass(kw_only=True, slots=True)


@cfg
class VariantSpec:
    """One named variant of the study."""

    describe: str = ""
    """What the variant is (printed in the plan and the table)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Config overrides on the base, ``key.path: value`` (each becomes ``--set key.path=value``)."""
    online: bool = False
    """A non-stationary run (``data.phases``): report the adaptation speed per phase change."""


@cfg
class StudySpec:
    """A matrix of variants x seeds at an equal sample budget."""

    base: str
    """Experiment YAML every run starts from (relative to the study file)."""
    samples_per_run: int
    """Trained samples per run: run.num_steps = samples_per_run / scheduler.batch_size."""
    seeds: int = 3
    """Seeds per variant (run.seed = base seed + 0, 1, ...); --seeds overrides."""
    jobs: int = 1
    """Runs in parallel on this machine; --jobs overrides."""
    threshold: float = 0.5
    """Training reward (trailing mean) at which 'steps to threshold' is counted."""
    default: list[str] = field(default_factory=list)
    """Variants of the default study (the whole matrix with --full)."""
    common: dict[str, Any] = field(default_factory=dict)
    """Overrides applied to every run before the variant's own."""
    variants: dict[str, VariantSpec] = field(default_factory=dict)
    """The named variants."""
    seconds_per_sample: float = 0.5
    """Wall seconds per trained sample on this machine, for the time estimate (measured runs refine it)."""
    startup_s: float = 90.0
    """Wall seconds a run needs before its first RL step (engines, warm-up), for the estimate."""


@dataclass(slots=True)
class PlannedRun:
    """One variant x seed."""

    variant: str
    seed_index: int
    run_dir: pathlib.Path
    overrides: list[str]
    """The full --set list of the run (common, variant, budget, seed)."""
    num_steps: int
    batch_size: int
    group_size: int
    online: bool


@dataclass(slots=True)
class Plan:
    spec: StudySpec
    base_path: pathlib.Path
    runs: list[PlannedRun]
    errors: dict[str, str]
    """Variant -> why its config does not load (e.g. an option that does not exist yet)."""


def load_study(path: str | pathlib.Path) -> tuple[StudySpec, pathlib.Path]:
    """The study file, strictly typed; returns the spec and the resolved base config path."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"--config {path}: no such study file (see configs/studies/paper-miniature.yaml)")
    spec = from_dict(StudySpec, load_yaml_tree(path), source=Sources(str(path)))
    unknown = [v for v in spec.default if v not in spec.variants]
    if unknown:
        raise ConfigError(f"{path}: default names unknown variant(s) {unknown}; known: {sorted(spec.variants)}")
    if spec.samples_per_run < 1 or spec.seeds < 1 or spec.jobs < 1:
        raise ConfigError(f"{path}: samples_per_run, seeds and jobs must be >= 1")
    return spec, (path.parent / spec.base).resolve()


def to_sets(overrides: dict[str, Any]) -> list[str]:
    """``{"a.b": v}`` -> ``["a.b=<v as JSON>"]`` (JSON is YAML: lists and mappings survive)."""
    return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]


def _shape(cfg: ExperimentConfig) -> tuple[int, int]:
    """(batch size, rollouts per prompt) of a resolved config."""
    group = cfg.algorithm.group_size if resolved_mode(cfg) != "single" else 1
    return cfg.scheduler.batch_size, group


def build_plan(spec: StudySpec, base: pathlib.Path, out: pathlib.Path, *, variants: list[str],
               seeds: int) -> Plan:
    """Resolve every variant's config (errors collected per variant) and lay out its seed runs."""
    runs, errors = [], {}
    for name in variants:
        v = spec.variants[name]
        sets = to_sets(spec.common) + to_sets(v.overrides)
        try:
            cfg = load_config(base, sets)
        except (ConfigError, ValueError) as exc:
            errors[name] = str(exc).splitlines()[0]
            continue
        batch, group = _shape(cfg)
        steps = max(1, spec.samples_per_run // batch)
        for k in range(seeds):
            run_sets = sets + [f"run.num_steps={steps}", f"run.seed={cfg.run.seed + k}"]
            runs.append(PlannedRun(name, k, out / name / f"seed{k}", run_sets, steps, batch, group, v.online))
    return Plan(spec, base, runs, errors)


def select_variants(spec: StudySpec, *, full: bool, only: list[str] | None) -> list[str]:
    if only:
        bad = [v for v in only if v not in spec.variants]
        if bad:
            raise ValueError(f"--variants: unknown {bad}; known: {sorted(spec.variants)}")
        return only
    return list(spec.variants) if full or not spec.default else list(spec.default)


def with_seeds(spec: StudySpec, seeds: int | None, jobs: int | None) -> StudySpec:
    return dataclasses.replace(spec, seeds=seeds or spec.seeds, jobs=jobs or spec.jobs)
