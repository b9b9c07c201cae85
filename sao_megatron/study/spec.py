"""The study file (``configs/studies/*.yaml``) and the nested plan it expands to.

A study names a base experiment config and a set of *variants* (arms), each a set of ``--set``
overrides on that base. The design is nested: the supervised warm-up runs once per warm-up seed
(``warmup.seeds`` = W, ``sao-megatron sft``) and is saved; every arm then runs R RL seeds per
warm-up (``rl_seeds``), each loading that warm-up's actor (``actor.load``, ``run.sft_steps=0``)
with a fresh optimizer. Run ``(w, r)`` of one arm and run ``(w, r)`` of another share the starting
weights and the RL seed, so the analysis pairs them.

All arms train on the same number of samples (``samples_per_run``): an arm's ``run.num_steps`` is
``samples_per_run / scheduler.batch_size`` of its resolved config, so a B x 8 arm (batch 8B) takes
an eighth of the steps of a B x 1 one, unless the arm sets ``equal_steps`` (as many steps as the
base batch size gives: 8x the samples). The plan names each arm's shape as prompts x rollouts.
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
WARMUP_ACTOR = "sft_actor"
"""Where ``sao-megatron sft`` writes the warmed-up actor inside its run directory."""
RL_SEED_OFFSET = 1000
"""RL seed of run (w, r): base seed + RL_SEED_OFFSET * (w + 1) + r (never a warm-up's seed)."""


@cfg
class VariantSpec:
    """One named arm of the study."""

    describe: str = ""
    """What the arm is (printed in the plan and the table)."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Config overrides on the base, ``key.path: value`` (each becomes ``--set key.path=value``)."""
    online: bool = False
    """A non-stationary run (``data.phases``): report the adaptation speed per phase change."""
    equal_steps: bool = False
    """Take as many RL steps as the base batch size gives (samples_per_run / base batch), not as many
    samples: the equal-steps control of a larger batch (8x the samples of a B x 1 arm)."""


@cfg
class WarmupSpec:
    """The shared supervised warm-ups: one ``sao-megatron sft`` run per warm-up seed."""

    seeds: int = 2
    """W: warm-up seeds (run.seed = base seed + 0, 1, ...); --warmup-seeds overrides."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Overrides of the warm-up run after ``common`` (e.g. run.sft_steps, the task's difficulty)."""


@cfg
class StudySpec:
    """A matrix of arms x (warm-up seed x RL seed) at an equal sample budget."""

    base: str
    """Experiment YAML every run starts from (relative to the study file)."""
    samples_per_run: int
    """Trained samples per run: run.num_steps = samples_per_run / scheduler.batch_size."""
    warmup: WarmupSpec = field(default_factory=WarmupSpec)
    """The shared warm-ups every arm loads."""
    rl_seeds: int = 4
    """R: RL seeds per warm-up and arm; --seeds overrides."""
    jobs: int = 1
    """Runs in parallel on this machine; --jobs overrides."""
    threshold: float = 0.5
    """Training reward (trailing mean) at which 'steps to threshold' is counted."""
    default: list[str] = field(default_factory=list)
    """Arms of the default study (the whole matrix with --full); the first is the paired reference."""
    common: dict[str, Any] = field(default_factory=dict)
    """Overrides applied to every run (warm-ups too) before the arm's own."""
    variants: dict[str, VariantSpec] = field(default_factory=dict)
    """The named arms."""
    seconds_per_sample: float = 0.5
    """Wall seconds per trained RL sample on this machine, for the time estimate (measured runs refine it)."""
    startup_s: float = 60.0
    """Wall seconds an RL run needs before its first step (engines, evaluation of the start), for the estimate."""
    warmup_s: float = 120.0
    """Wall seconds of one warm-up run, for the estimate."""


@dataclass(slots=True)
class PlannedWarmup:
    """One warm-up seed: an ``sao-megatron sft`` run whose actor every arm loads."""

    index: int
    run_dir: pathlib.Path
    overrides: list[str]

    @property
    def actor(self) -> pathlib.Path:
        return self.run_dir / WARMUP_ACTOR


@dataclass(slots=True)
class PlannedRun:
    """One arm x (warm-up seed, RL seed)."""

    variant: str
    warmup_index: int
    seed_index: int
    """The RL seed's index r within the warm-up."""
    run_dir: pathlib.Path
    overrides: list[str]
    """The full --set list of the run (common, arm, warm-up actor, budget, seed)."""
    num_steps: int
    batch_size: int
    group_size: int
    online: bool

    @property
    def pair(self) -> tuple[int, int]:
        """(warm-up seed, RL seed): the key the paired analysis matches runs of two arms on."""
        return self.warmup_index, self.seed_index


@dataclass(slots=True)
class Plan:
    spec: StudySpec
    base_path: pathlib.Path
    warmups: list[PlannedWarmup]
    runs: list[PlannedRun]
    errors: dict[str, str]
    """Arm -> why its config does not load (validation's first line)."""


def load_study(path: str | pathlib.Path) -> tuple[StudySpec, pathlib.Path]:
    """The study file, strictly typed; returns the spec and the resolved base config path."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"--config {path}: no such study file (see configs/studies/paper-miniature.yaml)")
    spec = from_dict(StudySpec, load_yaml_tree(path), source=Sources(str(path)))
    unknown = [v for v in spec.default if v not in spec.variants]
    if unknown:
        raise ConfigError(f"{path}: default names unknown variant(s) {unknown}; known: {sorted(spec.variants)}")
    if min(spec.samples_per_run, spec.rl_seeds, spec.warmup.seeds, spec.jobs) < 1:
        raise ConfigError(f"{path}: samples_per_run, rl_seeds, warmup.seeds and jobs must be >= 1")
    return spec, (path.parent / spec.base).resolve()


def to_sets(overrides: dict[str, Any]) -> list[str]:
    """``{"a.b": v}`` -> ``["a.b=<v as JSON>"]`` (JSON is YAML: lists and mappings survive)."""
    return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]


def _shape(cfg: ExperimentConfig) -> tuple[int, int]:
    """(batch size, rollouts per prompt) of a resolved config."""
    group = cfg.algorithm.group_size if resolved_mode(cfg) != "single" else 1
    return cfg.scheduler.batch_size, group


def plan_warmups(spec: StudySpec, base: pathlib.Path, out: pathlib.Path, seeds: int) -> list[PlannedWarmup]:
    """The W warm-up runs (``OUT/warmup/w<k>``): common, the warm-up's overrides and its seed."""
    sets = to_sets(spec.common) + to_sets(spec.warmup.overrides)
    seed = load_config(base, sets).run.seed
    return [PlannedWarmup(w, out / "warmup" / f"w{w}", sets + [f"run.seed={seed + w}"]) for w in range(seeds)]


def _arm_sets(spec: StudySpec, name: str) -> list[str]:
    # The arm loads a warm-up (weights only: a fresh optimizer) and never warms up itself.
    return to_sets(spec.common) + to_sets(spec.variants[name].overrides) + ["run.sft_steps=0"]


def build_plan(spec: StudySpec, base: pathlib.Path, out: pathlib.Path, *, variants: list[str],
               seeds: int | None = None, warmup_seeds: int | None = None) -> Plan:
    """Resolve every arm's config (errors collected per arm) and lay out its W x R runs."""
    seeds, wseeds = seeds or spec.rl_seeds, warmup_seeds or spec.warmup.seeds
    out = out.resolve()  # actor.load must not depend on the trainer's working directory
    warmups = plan_warmups(spec, base, out, wseeds)
    base_batch = load_config(base, to_sets(spec.common)).scheduler.batch_size
    runs, errors = [], {}
    for name in variants:
        v, sets = spec.variants[name], _arm_sets(spec, name)
        try:
            cfg = load_config(base, sets + [f"actor.load={json.dumps(str(warmups[0].actor))}"])
        except (ConfigError, ValueError) as exc:
            errors[name] = str(exc).splitlines()[0]
            continue
        batch, group = _shape(cfg)
        steps = max(1, spec.samples_per_run // (base_batch if v.equal_steps else batch))
        for wu in warmups:
            for r in range(seeds):
                seed = cfg.run.seed + RL_SEED_OFFSET * (wu.index + 1) + r
                run_sets = sets + [f"actor.load={json.dumps(str(wu.actor))}", f"run.num_steps={steps}",
                                   f"run.seed={seed}"]
                runs.append(PlannedRun(name, wu.index, r, out / name / f"w{wu.index}r{r}", run_sets, steps,
                                       batch, group, v.online))
    return Plan(spec, base, warmups, runs, errors)


def select_variants(spec: StudySpec, *, full: bool, only: list[str] | None) -> list[str]:
    if only:
        bad = [v for v in only if v not in spec.variants]
        if bad:
            raise ValueError(f"--variants: unknown {bad}; known: {sorted(spec.variants)}")
        return only
    return list(spec.variants) if full or not spec.default else list(spec.default)


def with_seeds(spec: StudySpec, seeds: int | None, jobs: int | None, warmup_seeds: int | None = None) -> StudySpec:
    warmup = dataclasses.replace(spec.warmup, seeds=warmup_seeds or spec.warmup.seeds)
    return dataclasses.replace(spec, rl_seeds=seeds or spec.rl_seeds, jobs=jobs or spec.jobs, warmup=warmup)
