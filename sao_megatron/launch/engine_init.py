"""The HF directory the rollout engines start from.

Engines on rollout nodes are up before the trainer, so they need weights of their own:
``--engine-model-dir``, else the config's ``model.hf_dir``. A CPU run from a randomly
initialised tiny model (no ``hf_dir``) gets a bootstrap directory instead: the trainer's HF
template (config.json + tokenizer) with seeded random weights, written once per run under
``RUN_DIR/launch/engine_init``. Only the architecture matters there: the trainer pushes its
own weights to the engines (``update_weights_from_disk``) before they generate for it.
"""

from __future__ import annotations

import logging
import os
import pathlib
import shutil

from sao_megatron.config import ExperimentConfig, load_config
from sao_megatron.launch.layout import LaunchPlan, server_kind

log = logging.getLogger(__name__)


def bootstrap_dir(run_dir: str) -> pathlib.Path:
    return pathlib.Path(run_dir) / "launch" / "engine_init"


def resolve(plan: LaunchPlan) -> tuple[str, bool]:
    """(model dir, whether it is a bootstrap dir still to be written); ValueError if there is none."""
    if plan.engine_model_dir:
        return plan.engine_model_dir, False
    hf_dir = load_config(plan.config, plan.overrides, check=False).model.hf_dir
    if hf_dir:
        return hf_dir, False
    if server_kind(plan) != "embedded":
        raise ValueError(f"{plan.config}: SGLang servers need real weights to start from: set model.hf_dir in "
                         f"the config or pass --engine-model-dir")
    out = bootstrap_dir(plan.run_dir)
    return str(out), not (out / "config.json").is_file()


def prepare(plan: LaunchPlan) -> str:
    """Resolve the engines' model dir, writing the bootstrap dir if needed (idempotent)."""
    model_dir, missing = resolve(plan)
    if missing:
        write_bootstrap(load_config(plan.config, plan.overrides, check=False), pathlib.Path(model_dir))
    return model_dir


def write_bootstrap(cfg: ExperimentConfig, out: pathlib.Path) -> None:
    """Template + seeded random weights, published with one rename (concurrent writers are harmless)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from sao_megatron.envs import build_task
    from sao_megatron.models.families import write_hf_template

    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write_hf_template(cfg.model, getattr(build_task(cfg.data, model=cfg.model), "tokenizer", None), tmp)
    template_config = (tmp / "config.json").read_text()
    torch.manual_seed(cfg.run.seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp))
    model.save_pretrained(tmp, safe_serialization=True)
    # Keep the trainer's config.json byte for byte: engines compare it on every weight swap.
    (tmp / "config.json").write_text(template_config)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:  # another node published it first
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("engine bootstrap weights in %s", out)
