"""The submit-time description of a Slurm run and the per-node commands it implies.

Layout of one allocation of ``nodes_train + nodes_rollout`` nodes (in ``scontrol show
hostnames`` order): the first ``nodes_train`` nodes run the trainer (one ``torchrun`` per
node, static rendezvous on trainer node 0), the last ``nodes_rollout`` nodes run the engines
(SGLang servers on GPUs, ``sao-megatron serve-local`` on CPU) and, on rollout node 0, the
sglang-router. The trainer reaches them over HTTP through ``--set rollout.*`` overrides.

Ports come from the job id so that jobs sharing a host (the emulated cluster, or
``--overlap``/oversubscribed nodes) never collide: job ``j`` owns
``[port_base(j, eph), port_base(j, eph) + PORTS_PER_JOB)``, one of the blocks of
``PORTS_PER_JOB`` ports in ``[PORT_RANGE_START, 65536)`` that lie outside the node's ephemeral
port range ``eph`` (``net.ipv4.ip_local_port_range``, read on the node at launch): the kernel
hands ports of that range to every outgoing connection (and to ``bind(port=0)``), so a server
port inside it can be taken by any client socket on the node. With Linux's default range
32768-60999 there are 85 blocks (20000-32599 and 61000-65399). Everything here is pure (no
Slurm calls, no /proc reads).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from sao_megatron.net import PORTS_PER_JOB

cfg = dataclass(kw_only=True, slots=True)

PROMETHEUS_PORT_OFFSET = PORTS_PER_JOB - 3  # the router's metrics port (its default 29000 would collide)
ROUTER_PORT_OFFSET = PORTS_PER_JOB - 1
MAX_ENGINES = PORTS_PER_JOB - 3


@cfg
class LaunchPlan:
    """Everything needed to submit one run: the experiment plus its Slurm shape."""

    config: str
    """Experiment YAML (absolute path, on a file system the nodes share)."""
    overrides: list[str] = field(default_factory=list)
    """``--set KEY=VALUE`` overrides handed to the trainer (the layout's rollout.* ones go last)."""
    run_dir: str
    """Run directory (absolute, shared): checkpoints, metrics, logs; reused on requeue."""
    nodes_train: int = 1
    """Trainer nodes (torchrun per node)."""
    nodes_rollout: int = 1
    """Rollout nodes (engines); 0 leaves engines to the config (e.g. the trainer's embedded ones)."""
    gpus_per_node: int = 0
    """GPUs per node; 0 means CPU nodes (gloo trainer, embedded engine)."""
    procs_per_node: int | None = None
    """Trainer processes per node (None: gpus_per_node, or 1 on CPU)."""
    gpus_per_engine: int | None = None
    """GPUs per SGLang server, i.e. its TP size (None: all GPUs of the node)."""
    server: Literal["auto", "sglang", "embedded"] = "auto"
    """Engine server on rollout nodes (auto: sglang with GPUs, embedded without)."""
    engine_model_dir: str | None = None
    """HF directory the engines load at start (None: the config's model.hf_dir)."""
    engine_args: list[str] = field(default_factory=list)
    """Extra arguments appended to every engine server command."""
    router: Literal["auto", "sglang_router", "none"] = "auto"
    """sglang-router in front of the engines (auto: only with more than one engine)."""
    partition: str | None = None
    """Slurm partition (None: the cluster's default)."""
    time_min: int = 60
    """Job time limit in minutes (each requeued run gets it again)."""
    job_name: str = "sao-megatron"
    """Slurm job name."""
    container_image: str | None = None
    """pyxis/enroot image for every srun step (None: run on the host)."""
    container_mounts: str | None = None
    """pyxis ``--container-mounts`` (must include the repo and run_dir when an image is used)."""
    signal_lead_s: int = 120
    """Seconds before the time limit at which the trainer is told (SIGUSR1) to checkpoint."""
    shutdown_timeout_s: int = 600
    """Seconds torchrun lets its ranks finish a checkpoint after a signal before killing them."""
    iface: str = "auto"
    """Network interface for gloo and NCCL on every node (GLOO_/NCCL_SOCKET_IFNAME); auto: the one
    carrying the node's own address (see ``launch/network.py``)."""
    max_requeues: int = 10
    """Requeues (time limit or preemption) before the launcher gives up."""


def server_kind(plan: LaunchPlan) -> Literal["sglang", "embedded"]:
    if plan.server != "auto":
        return plan.server
    return "sglang" if plan.gpus_per_node > 0 else "embedded"


def engines_per_node(plan: LaunchPlan) -> int:
    """SGLang: one server per group of ``gpus_per_engine`` GPUs; embedded: one per node."""
    if plan.nodes_rollout == 0:
        return 0
    if server_kind(plan) == "embedded" or plan.gpus_per_node == 0:
        return 1
    return max(1, plan.gpus_per_node // (plan.gpus_per_engine or plan.gpus_per_node))


def procs_per_node(plan: LaunchPlan) -> int:
    return plan.procs_per_node or plan.gpus_per_node or 1


def trainer_world_size(plan: LaunchPlan) -> int:
    return plan.nodes_train * procs_per_node(plan)


def uses_router(plan: LaunchPlan) -> bool:
    if plan.router == "auto":
        return plan.nodes_rollout * engines_per_node(plan) > 1
    return plan.router == "sglang_router" and plan.nodes_rollout > 0


def check_plan(plan: LaunchPlan) -> None:
    """Raise ValueError naming the flag and the fix for an inconsistent plan (no I/O)."""
    errors = []
    if plan.nodes_train < 1:
        errors.append(f"--nodes-train={plan.nodes_train}: the trainer needs at least one node")
    if plan.nodes_rollout < 0:
        errors.append(f"--nodes-rollout={plan.nodes_rollout} must be >= 0")
    if plan.gpus_per_node < 0:
        errors.append(f"--gpus-per-node={plan.gpus_per_node} must be >= 0")
    if server_kind(plan) == "sglang" and plan.nodes_rollout and plan.gpus_per_node == 0:
        errors.append("SGLang servers need GPUs: pass --gpus-per-node or use the embedded engine (--server embedded)")
    gpe = plan.gpus_per_engine
    if gpe is not None and (gpe < 1 or plan.gpus_per_node % gpe):
        errors.append(f"--gpus-per-engine={gpe} must be >= 1 and divide --gpus-per-node={plan.gpus_per_node}")
    elif plan.nodes_rollout * engines_per_node(plan) > MAX_ENGINES:
        errors.append(f"{plan.nodes_rollout * engines_per_node(plan)} engines exceed the {MAX_ENGINES} ports a "
                      f"job owns: use larger --gpus-per-engine or fewer --nodes-rollout")
    if plan.time_min < 1:
        errors.append(f"--time={plan.time_min} min must be >= 1")
    elif plan.signal_lead_s >= plan.time_min * 60:
        errors.append(f"signal lead {plan.signal_lead_s} s must be shorter than the time limit "
                      f"({plan.time_min} min): raise --time or lower --signal-lead")
    if errors:
        raise ValueError("invalid launch plan:\n  " + "\n  ".join(errors))


def engine_endpoints(rollout_addrs: list[str], base: int, per_node: int) -> list[tuple[str, int]]:
    """(address, port) of every engine, rollout node by node; ports never repeat in a job."""
    return [(addr, base + i * per_node + k) for i, addr in enumerate(rollout_addrs) for k in range(per_node)]


def url(addr: str, port: int) -> str:
    host = f"[{addr}]" if ":" in addr else addr
    return f"http://{host}:{port}"


def router_endpoint(rollout_addrs: list[str], base: int) -> tuple[str, int]:
    return rollout_addrs[0], base + ROUTER_PORT_OFFSET


def rollout_overrides(engine_urls: list[str], router_url: str | None) -> list[str]:
    """``--set`` items telling the trainer where the layout's engines (and router) are."""
    if not engine_urls:
        return []
    out = ["rollout.engine=sglang", f"rollout.engine_urls={json.dumps(engine_urls)}"]
    if router_url:
        out += ["rollout.router=sglang_router", f"rollout.router_url={router_url}"]
    return out


def trainer_argv(plan: LaunchPlan, *, python: str, node_rank: int, master_addr: str, master_port: int,
                 layout_overrides: list[str], wait_for: list[str], local_addr: str | None = None) -> list[str]:
    """torchrun on one trainer node; each rank waits for ``wait_for`` (/health), then runs
    ``sao-megatron train ... --resume auto`` (see ``train_entry``)."""
    sets = [a for item in plan.overrides + layout_overrides for a in ("--set", item)]
    waits = [a for u in wait_for for a in ("--wait-for", u)]
    return [python, "-m", "torch.distributed.run",
            f"--nnodes={plan.nodes_train}", f"--nproc-per-node={procs_per_node(plan)}",
            f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={master_port}",
            f"--shutdown-timeout={plan.shutdown_timeout_s}",
            *([f"--local-addr={local_addr}"] if local_addr else []),  # else torchrun asks getfqdn()
            "-m", "sao_megatron.launch.train_entry", *waits, "--",
            "train", "--config", plan.config, "--run-dir", plan.run_dir, "--resume", "auto", *sets]


def engine_argv(plan: LaunchPlan, *, python: str, model_dir: str, host: str, port: int, local_index: int,
                return_routed_experts: bool = False, api_key: str | None = None) -> list[str]:
    """The server command of engine ``local_index`` on a rollout node."""
    if server_kind(plan) == "embedded":
        argv = [python, "-m", "sao_megatron.cli", "serve-local", "--model-dir", model_dir,
                "--host", host, "--port", str(port)]
    else:
        tp = plan.gpus_per_engine or plan.gpus_per_node
        argv = [python, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", host, "--port", str(port)]
        if tp:  # a CPU rollout node (--server sglang, no GPUs) runs one server per node, without TP
            argv += ["--tp-size", str(tp), "--base-gpu-id", str(local_index * tp)]
    argv += ["--weight-version", "0"]
    if return_routed_experts:
        argv.append("--enable-return-routed-experts")
    if api_key:
        argv += ["--api-key", api_key]
    return argv + list(plan.engine_args)


def router_argv(*, python: str, host: str, port: int, worker_urls: list[str], model_dir: str,
                request_timeout_s: float, api_key: str | None = None) -> list[str]:
    """sglang-router in front of the engines: retries off, so a failed generation surfaces instead of
    silently running twice; a local tokenizer, so it never reaches for the HF hub."""
    argv = [python, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", "cache_aware", "--disable-retries", "--log-level", "warn",
            "--request-timeout-secs", str(int(request_timeout_s)), "--tokenizer-path", model_dir,
            "--prometheus-host", host,
            "--prometheus-port", str(port - ROUTER_PORT_OFFSET + PROMETHEUS_PORT_OFFSET)]
    return argv + (["--api-key", api_key] if api_key else [])
