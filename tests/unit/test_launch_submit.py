"""Submit-time checks and the generated sbatch of `sao-megatron launch` (no cluster needed)."""

from __future__ import annotations

import pickle
import re

import pytest

from sao_megatron.config import ConfigError
from sao_megatron.launch import engine_init
from sao_megatron.launch import submit as sb
from sao_megatron.launch.layout import LaunchPlan
from sao_megatron.launch.slurm_query import Partition, check_nodes_fit

pytestmark = pytest.mark.unit


@pytest.fixture
def experiment(tmp_path):
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("run: {num_steps: 3}\n")
    model = tmp_path / "hf"
    model.mkdir()
    return cfg, model


def make_plan(tmp_path, cfg, model, **kw) -> LaunchPlan:
    return LaunchPlan(**{"config": str(cfg), "run_dir": str(tmp_path / "run"), "engine_model_dir": str(model),
                         **kw})


def sbatch_flags(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", text, flags=re.M))


def test_sbatch_asks_usr1_before_the_limit_and_requeue(tmp_path, experiment):
    plan = make_plan(tmp_path, *experiment, nodes_train=2, nodes_rollout=1, time_min=30, signal_lead_s=90,
                     partition="gpu", gpus_per_node=8)
    text = sb.render_sbatch(plan, cpus_per_node=64, python="/venv/bin/python")
    flags = sbatch_flags(text)
    assert flags["nodes"] == "3" and flags["ntasks-per-node"] == "1"
    assert flags["signal"] == "URG@90"  # harmless step-wide (default: ignore), unlike submitit's USR2
    assert flags["time"] == "30" and flags["partition"] == "gpu" and flags["gpus-per-node"] == "8"
    assert flags["cpus-per-task"] == "64" and flags["mem"] == "0"
    assert "requeue" in flags and "exclusive" in flags
    assert "export SUBMITIT_PREEMPT_SIGNAL=URG" in text   # submitit's handler must listen to the same signal
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert srun.endswith(f"/venv/bin/python -u -m submitit.core._submit {tmp_path / 'run'}/launch/submitit/%j")
    assert "--container-image" not in srun


def test_sbatch_container_flags(tmp_path, experiment):
    plan = make_plan(tmp_path, *experiment, container_image="nvcr.io#nvidia/pytorch:25.01-py3",
                     container_mounts="/lustre:/lustre")
    srun = next(line for line in sb.render_sbatch(plan, None, "python").splitlines() if line.startswith("srun "))
    assert "--container-image=nvcr.io#nvidia/pytorch:25.01-py3" in srun
    assert "--container-mounts=/lustre:/lustre" in srun


def test_validate_accepts_a_good_plan_and_creates_the_run_dir(tmp_path, experiment):
    plan = make_plan(tmp_path, *experiment)
    assert sb.validate(plan, query_cluster=False) is None
    assert (tmp_path / "run").is_dir()


def test_missing_config_is_named(tmp_path, experiment):
    plan = make_plan(tmp_path, tmp_path / "nope.yaml", experiment[1])
    with pytest.raises(ValueError, match=r"config file not found: .*nope\.yaml"):
        sb.validate(plan, query_cluster=False)


def test_bad_config_key_fails_at_submit(tmp_path, experiment):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: {num_stepz: 3}\n")
    with pytest.raises(ConfigError, match="num_stepz"):
        sb.validate(make_plan(tmp_path, bad, experiment[1]), query_cluster=False)


def test_unwritable_run_dir(tmp_path, experiment):
    blocker = tmp_path / "file"
    blocker.write_text("")
    plan = make_plan(tmp_path, *experiment, run_dir=str(blocker / "run"))
    with pytest.raises(ValueError, match="is not writable"):
        sb.validate(plan, query_cluster=False)


def test_engines_need_weights(tmp_path, experiment):
    plan = make_plan(tmp_path, experiment[0], tmp_path / "missing")
    with pytest.raises(ValueError, match="does not exist"):
        sb.validate(plan, query_cluster=False)
    # GPU engines need real weights; CPU ones get a bootstrap dir written in the job
    gpu = make_plan(tmp_path, experiment[0], experiment[1], engine_model_dir=None, gpus_per_node=8)
    with pytest.raises(ValueError, match="model.hf_dir"):
        sb.validate(gpu, query_cluster=False)
    cpu = make_plan(tmp_path, experiment[0], experiment[1], engine_model_dir=None)
    sb.validate(cpu, query_cluster=False)
    assert engine_init.resolve(cpu) == (str(tmp_path / "run" / "launch" / "engine_init"), True)
    # no rollout nodes: the config's own engines, nothing to check
    sb.validate(make_plan(tmp_path, experiment[0], None, nodes_rollout=0), query_cluster=False)


@pytest.mark.parametrize("total,max_nodes,ok", [(4, None, True), (3, None, False), (8, 3, False), (8, 4, True)])
def test_nodes_must_fit_the_partition(tmp_path, experiment, total, max_nodes, ok):
    plan = make_plan(tmp_path, *experiment, nodes_train=3, nodes_rollout=1)
    part = Partition(name="debug", total_nodes=total, max_nodes=max_nodes, is_default=True)
    if ok:
        check_nodes_fit(plan, part)
    else:
        with pytest.raises(ValueError, match=r"needs 4 nodes .* partition 'debug' allows at most 3"):
            check_nodes_fit(plan, part)


def test_layout_job_pickles_without_runtime_state(tmp_path, experiment):
    job = sb.LayoutJob(make_plan(tmp_path, *experiment))
    job._signalled.set()
    copy = pickle.loads(pickle.dumps(job))
    assert copy.plan == job.plan and not copy._signalled.is_set()
