"""Read-only Slurm look-ups (scontrol/sinfo) and the submit-time checks built on them."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from sao_megatron.config import load_config
from sao_megatron.launch.layout import LaunchPlan, trainer_world_size


class SlurmUnavailable(RuntimeError):
    """Slurm's client commands are missing or the controller does not answer."""


@dataclass(frozen=True, slots=True)
class Partition:
    """One partition as ``scontrol show partition`` reports it."""

    name: str
    total_nodes: int
    max_nodes: int | None
    is_default: bool
    cpus_per_node: int | None = None
    """Fewest CPUs of any node in the partition (what one task per node can ask for)."""


def _run(argv: list[str], timeout_s: float = 30.0) -> str:
    if shutil.which(argv[0]) is None:
        raise SlurmUnavailable(f"`{argv[0]}` not found: run on a Slurm login node (or start the local "
                               f"cluster: bash scripts/slurm_cluster.sh start)")
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise SlurmUnavailable(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _fields(line: str) -> dict[str, str]:
    return dict(tok.split("=", 1) for tok in line.split() if "=" in tok)


def partitions() -> list[Partition]:
    out = []
    for line in _run(["scontrol", "show", "partition", "-o"]).splitlines():
        f = _fields(line)
        if "PartitionName" not in f:
            continue
        max_nodes = f.get("MaxNodes", "UNLIMITED")
        out.append(Partition(name=f["PartitionName"], total_nodes=int(f.get("TotalNodes", "0")),
                             max_nodes=None if max_nodes == "UNLIMITED" else int(max_nodes),
                             is_default=f.get("Default") == "YES"))
    return out


def find_partition(name: str | None) -> Partition:
    """The named partition, or the cluster's default one; ValueError listing the choices otherwise."""
    parts = partitions()
    for p in parts:
        if (name is None and p.is_default) or p.name == name:
            cpus = [int(c.rstrip("+")) for c in _run(["sinfo", "-h", "-p", p.name, "-o", "%c"]).split()
                    if c.rstrip("+").isdigit()]
            return dataclasses.replace(p, cpus_per_node=min(cpus) if cpus else None)
    names = ", ".join(p.name for p in parts) or "none"
    what = f"partition {name!r} does not exist" if name else "the cluster has no default partition"
    raise ValueError(f"{what}: choose --partition from: {names}")


def hostnames(nodelist: str) -> list[str]:
    """Expand a Slurm node list (``n[1-3],gpu7``) in Slurm's own order."""
    return _run(["scontrol", "show", "hostnames", nodelist]).split()


def node_addresses(names: list[str]) -> list[str]:
    """NodeAddr of each node (what other nodes connect to; equals the hostname on most clusters)."""
    addrs = {}
    for line in _run(["scontrol", "show", "node", "-o", ",".join(names)]).splitlines():
        f = _fields(line)
        if "NodeName" in f:
            addrs[f["NodeName"]] = f.get("NodeAddr") or f["NodeName"]
    return [addrs.get(n, n) for n in names]


def check_nodes_fit(plan: LaunchPlan, partition: Partition) -> None:
    needed = plan.nodes_train + plan.nodes_rollout
    limit = partition.total_nodes if partition.max_nodes is None else min(partition.total_nodes,
                                                                          partition.max_nodes)
    if needed > limit:
        raise ValueError(f"the layout needs {needed} nodes (--nodes-train {plan.nodes_train} + --nodes-rollout "
                         f"{plan.nodes_rollout}) but partition {partition.name!r} allows at most {limit}: "
                         f"lower the node counts or choose a bigger --partition")


def check_config(plan: LaunchPlan) -> None:
    """The experiment loads and validates for the trainer's world size (ConfigError otherwise)."""
    load_config(plan.config, plan.overrides, world_size=trainer_world_size(plan))


def check_run_dir(run_dir: str | pathlib.Path) -> None:
    """Create the run directory and prove it is writable (a file is written and removed)."""
    path = pathlib.Path(run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise ValueError(f"run directory {str(path)!r} is not writable ({exc.strerror}): choose another "
                         f"--run-dir on a file system every node can write") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"run directory {str(path)!r} is not writable: choose another --run-dir")


def job_in_queue(job_id: str) -> bool:
    """Whether the job is pending, running, completing or requeued (``squeue`` lists it)."""
    proc = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%i"], capture_output=True, text=True,
                          timeout=60, check=False)
    if proc.returncode != 0 and "Invalid job id" not in proc.stderr:
        raise SlurmUnavailable(f"squeue failed ({proc.returncode}): {proc.stderr.strip()}")
    return bool(proc.stdout.strip())
