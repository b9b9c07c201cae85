"""Submit the trainer + rollout layout with submitit (``sao-megatron launch``).

One submitit task per node: the first ``nodes_train`` tasks run the trainer (torchrun),
the others the engines, exactly as ``slurm/sao_rl.sbatch`` does with two srun steps.

Requeue: the job is submitted with ``--signal=URG@<signal_lead_s>`` and submitit listens to
SIGURG (``SUBMITIT_PREEMPT_SIGNAL``). Slurm delivers it to every process of the step, and
SIGURG is ignored by default, so nothing dies of it (SIGUSR1 there would kill the ranks'
checkpoint-writer helpers). submitit calls ``LayoutJob.checkpoint`` on task 0, which touches
the checkpoint request file (every trainer node runner then sends SIGUSR1 to its ranks: they
checkpoint and exit), waits for the local ranks to finish and hands submitit a fresh copy of
the job to requeue; the rerun passes ``--resume auto``. A preemption or ``scontrol requeue``
sends SIGTERM instead: the ranks may save within KillWait and Slurm requeues the job itself.
"""

from __future__ import annotations

import logging
import os
import pathlib
import signal
import threading
import time
from typing import Any

import psutil

from sao_megatron.launch import engine_init
from sao_megatron.launch import node as nd
from sao_megatron.launch import layout as lp
from sao_megatron.launch import slurm_query as sq
from sao_megatron.launch.layout import LaunchPlan

log = logging.getLogger(__name__)
PREEMPT_SIGNAL = "URG"

try:  # submitit is a declared dependency; the import is kept lazy-safe for --help
    from submitit.helpers import Checkpointable, DelayedSubmission
except ImportError:  # pragma: no cover
    Checkpointable = object  # type: ignore[misc,assignment]


def submitit_folder(plan: LaunchPlan) -> pathlib.Path:
    return pathlib.Path(plan.run_dir) / "launch" / "submitit"


def container_srun_args(plan: LaunchPlan) -> list[str]:
    if not plan.container_image:
        return []
    mounts = plan.container_mounts or f"{os.getcwd()}:{os.getcwd()},{plan.run_dir}:{plan.run_dir}"
    return [f"--container-image={plan.container_image}", f"--container-mounts={mounts}",
            f"--container-workdir={os.getcwd()}"]


def sbatch_parameters(plan: LaunchPlan, cpus_per_node: int | None) -> dict[str, Any]:
    """submitit's ``_make_sbatch_string`` parameters for the layout (one task per node)."""
    params: dict[str, Any] = dict(
        job_name=plan.job_name, nodes=plan.nodes_train + plan.nodes_rollout, ntasks_per_node=1,
        time=plan.time_min, signal_delay_s=plan.signal_lead_s, exclusive=True,
        # submitit would write --signal=USR2@lead: USR2 kills every process that does not handle it.
        additional_parameters={"signal": f"{PREEMPT_SIGNAL}@{plan.signal_lead_s}", "mem": "0",
                               "requeue": True},
        setup=[f"export SUBMITIT_PREEMPT_SIGNAL={PREEMPT_SIGNAL}"],
        srun_args=container_srun_args(plan),
    )
    if cpus_per_node:
        params["cpus_per_task"] = cpus_per_node  # a step task otherwise gets one CPU
    if plan.partition:
        params["partition"] = plan.partition
    if plan.gpus_per_node:
        params["gpus_per_node"] = plan.gpus_per_node
    return params


def render_sbatch(plan: LaunchPlan, cpus_per_node: int | None, python: str) -> str:
    """The sbatch script submitit would write (``--dry-run``)."""
    from submitit.slurm.slurm import _make_sbatch_string

    folder = submitit_folder(plan) / "%j"
    command = f"{python} -u -m submitit.core._submit {folder}"
    return _make_sbatch_string(command=command, folder=folder, **sbatch_parameters(plan, cpus_per_node))


def validate(plan: LaunchPlan, *, query_cluster: bool = True) -> sq.Partition | None:
    """Every submit-time check; ValueError (or ConfigError) with the fix, before anything is submitted."""
    lp.check_plan(plan)
    if not os.path.isfile(plan.config):
        raise ValueError(f"config file not found: {plan.config}: pass --config path/to/experiment.yaml")
    sq.check_config(plan)
    sq.check_run_dir(plan.run_dir)
    if plan.nodes_rollout:
        model_dir, bootstrap = engine_init.resolve(plan)
        if not bootstrap and not os.path.isdir(model_dir):
            raise ValueError(f"engine model directory {model_dir!r} does not exist: the rollout nodes load it "
                             f"at start (set model.hf_dir or --engine-model-dir)")
    if not query_cluster:
        return None
    partition = sq.find_partition(plan.partition)
    sq.check_nodes_fit(plan, partition)
    return partition


class LayoutJob(Checkpointable):
    """The submitit callable: this node's part of the layout (one task per node)."""

    def __init__(self, plan: LaunchPlan):
        self.plan = plan
        self._signalled = threading.Event()
        self._checkpoint_file: pathlib.Path | None = None

    def __call__(self) -> int:
        import submitit

        rank = submitit.JobEnvironment().global_rank
        alloc = nd.allocation_from_slurm(self.plan)
        stop_file = nd.stop_file_path(self.plan.run_dir, alloc)
        if rank >= self.plan.nodes_train:
            stop = threading.Event()
            signal.signal(signal.SIGTERM, lambda s, f: stop.set())
            return nd.run_rollout_node(self.plan, alloc, rank - self.plan.nodes_train, stop=stop,
                                       stop_file=stop_file)
        self._chain_signals()
        self._checkpoint_file = nd.checkpoint_request_path(self.plan.run_dir, alloc)
        try:
            code = nd.run_trainer_node(self.plan, alloc, rank, checkpoint_file=self._checkpoint_file)
        finally:
            if rank == 0:
                stop_file.parent.mkdir(parents=True, exist_ok=True)
                stop_file.touch()
        if self._signalled.is_set():
            # Slurm is requeueing or ending the job; a return would record a result for an
            # unfinished run, so leave without one.
            log.info("trainer node %d: ranks exited after a signal; leaving for the requeue", rank)
            os._exit(0)
        if code != 0:
            raise RuntimeError(f"trainer node {rank}: torchrun exited with {code}; see the job's logs")
        return code

    def _chain_signals(self) -> None:
        """Note the preemption signal and SIGTERM, keeping submitit's own handler for the former."""
        preempt = getattr(signal, f"SIG{PREEMPT_SIGNAL}")
        prev = signal.getsignal(preempt)

        def on_preempt(signum, frame):
            self._signalled.set()
            if callable(prev):
                prev(signum, frame)  # task 0: submitit -> self.checkpoint() -> requeue

        signal.signal(preempt, on_preempt)
        signal.signal(signal.SIGTERM, lambda s, f: self._signalled.set())

    def checkpoint(self, *args: Any, **kwargs: Any) -> DelayedSubmission:
        """Task 0, time limit near: ask every trainer node to checkpoint, wait for the local
        ranks to exit, then let submitit requeue a fresh copy of the job."""
        self._signalled.set()
        if self._checkpoint_file is not None:
            self._checkpoint_file.parent.mkdir(parents=True, exist_ok=True)
            self._checkpoint_file.touch()
        _wait_for_descendants(timeout_s=self.plan.shutdown_timeout_s + 30)
        return DelayedSubmission(LayoutJob(self.plan))

    def __getstate__(self) -> dict[str, Any]:
        return {"plan": self.plan}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.plan = state["plan"]
        self._signalled = threading.Event()
        self._checkpoint_file = None


def _wait_for_descendants(timeout_s: float) -> None:
    """Runs inside a signal handler: poll the process table, never ``Popen.wait`` (its lock is held)."""
    deadline = time.monotonic() + timeout_s
    me = psutil.Process()
    while time.monotonic() < deadline:
        live = [p for p in me.children(recursive=True) if _alive(p)]
        if not live:
            return
        time.sleep(0.5)
    log.warning("ranks still running %.0f s after the checkpoint signal; requeueing anyway", timeout_s)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def submit(plan: LaunchPlan, partition: sq.Partition | None):
    """Submit the layout; returns the submitit job."""
    import submitit

    python = "python" if plan.container_image else None
    executor = submitit.SlurmExecutor(folder=submitit_folder(plan) / "%j", max_num_timeout=plan.max_requeues,
                                      python=python)
    executor.update_parameters(**sbatch_parameters(plan, partition.cpus_per_node if partition else None))
    return executor.submit(LayoutJob(plan))


def wait_for(job, *, poll_s: float = 2.0, grace_s: float = 30.0) -> Any:
    """Block until task 0 (trainer node 0) has a result; return it or raise the job's failure.

    Polls the result file and ``squeue`` (submitit's own polling needs ``sacct``, which
    clusters without accounting lack). A job that leaves the queue without a result for
    ``grace_s`` failed outside Python (killed, node failure).
    """
    task0 = job.task(0)
    gone_since = None
    while not task0.paths.result_pickle.exists():
        if sq.job_in_queue(job.job_id):
            gone_since = None
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since > grace_s:
            raise RuntimeError(f"job {job.job_id} ended without a result; see {task0.paths.stdout} and "
                               f"{task0.paths.stderr}")
        time.sleep(poll_s)
    return task0.result()
