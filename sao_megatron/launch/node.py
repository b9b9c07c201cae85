"""What runs on one node of a launched allocation (sbatch script and submitit job alike).

``sao-megatron node train|rollout --config X.yaml --run-dir D [layout flags]`` (also
``python -m sao_megatron.launch.node``) is started by ``srun`` on each trainer node / rollout node. It reads the allocation from
``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST`` and ``SLURM_NODEID`` (the node's index within its
step), then:

- trainer node: runs torchrun (static rendezvous on trainer node 0) for ``sao-megatron train
  --resume auto``, whose ranks first wait until every engine (and the router) answers
  ``/health`` (``train_entry``), and exits with its status once every process it started
  has exited.
- rollout node: starts its engine servers, on rollout node 0 also the router once all
  engines are healthy, and keeps them up until the stop file appears or SIGTERM/SIGINT. An
  engine that exits, or that stops answering ``/model_info`` once it has answered (hung), is
  killed and started again on its port, up to ``rollout.engine_restart_budget`` times; the
  trainer's supervisor (``rollout.supervisor``) loads the current weights into it and returns it
  to the router.

Signals. Checkpoint-and-exit (time limit near) is a request file in the run directory: the
trainer node runners send SIGUSR1 to their ranks only (torchrun's children). A step-wide
Slurm signal would also reach the ranks' helper processes (multiprocessing managers of the
checkpoint writer), which die on it and break the save. SIGTERM (cancel, preemption,
requeue) does come step-wide from Slurm; the ranks get it themselves (and once more from
torchrun). On trainer nodes the runner ignores signals and becomes the child subreaper, so
it outlives every rank: an exiting task ends the step and would kill a rank mid-checkpoint.
Engines start with SIGUSR1/SIGUSR2 ignored: a signal aimed at the trainer must never take a
server down.

Network. Every address comes from Slurm's ``NodeAddr`` of the node (never loopback): the
rendezvous on trainer node 0's address, each engine and the router bound to their rollout
node's address. Every process a runner starts gets ``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME`` from ``--iface`` (``launch/network.py``).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import psutil

from sao_megatron import net
from sao_megatron.launch import layout as lp
from sao_megatron.launch import network
from sao_megatron.launch.layout import LaunchPlan
from sao_megatron.rollout.health import headers_for, wait_healthy

log = logging.getLogger(__name__)
_PR_SET_CHILD_SUBREAPER = 36
ENGINE_START_TIMEOUT_S = 1800.0  # large MoE checkpoints take many minutes to load
HANG_PROBES, PROBE_TIMEOUT_S = 3, 5.0  # checks without an answer before an engine counts as hung


@dataclass(frozen=True, slots=True)
class Allocation:
    """Where the layout's pieces are in the running job."""

    job_id: int
    restart: int
    """SLURM_RESTART_COUNT: 0 for the first run of the job, +1 per requeue."""
    train_addrs: list[str]
    rollout_addrs: list[str]
    port_base: int


def allocation_from_slurm(plan: LaunchPlan, env: dict[str, str] | None = None) -> Allocation:
    """Split ``SLURM_JOB_NODELIST`` (scontrol order) into trainer and rollout nodes."""
    from sao_megatron.launch.slurm_query import hostnames, node_addresses

    env = os.environ if env is None else env
    names = hostnames(env["SLURM_JOB_NODELIST"])
    needed = plan.nodes_train + plan.nodes_rollout
    if len(names) < needed:
        raise ValueError(f"the job has {len(names)} nodes but the layout needs {needed}")
    addrs = node_addresses(names[:needed])
    job_id = int(env["SLURM_JOB_ID"])
    # Every node reads its own range: they agree when the nodes share the sysctl (one image).
    ephemeral = net.ephemeral_port_range()
    base = net.port_base(job_id, ephemeral)
    log.info("job %d: ports %d-%d (ephemeral range %d-%d)", job_id, base, base + net.PORTS_PER_JOB - 1, *ephemeral)
    return Allocation(job_id=job_id, restart=int(env.get("SLURM_RESTART_COUNT", "0")),
                      train_addrs=addrs[:plan.nodes_train],
                      rollout_addrs=addrs[plan.nodes_train:needed], port_base=base)


def endpoints(plan: LaunchPlan, alloc: Allocation) -> tuple[list[str], str | None]:
    """Engine URLs and the router URL (None without a router) of this allocation."""
    urls = [lp.url(a, p) for a, p in lp.engine_endpoints(alloc.rollout_addrs, alloc.port_base,
                                                          lp.engines_per_node(plan))]
    router = lp.url(*lp.router_endpoint(alloc.rollout_addrs, alloc.port_base)) if lp.uses_router(plan) else None
    return urls, router


def node_env(plan: LaunchPlan, alloc: Allocation, own_addr: str) -> dict[str, str]:
    """This process's environment plus the interface for gloo/NCCL (ValueError if there is none)."""
    network.check_reachable(alloc.train_addrs + alloc.rollout_addrs)
    iface = network.select_iface(plan.iface, own_addr)
    log.info("node %s: gloo and NCCL use interface %s", own_addr, iface)
    return {**os.environ, **network.iface_env(iface)}


def _ignore_checkpoint_signals() -> None:  # runs in the child between fork and exec
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def _become_subreaper() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: orphans go to init, nothing else changes
        log.warning("could not become child subreaper; ranks orphaned by torchrun are not waited for")


def _reap_all(first: subprocess.Popen, others_before: set[int]) -> int:
    """Wait for ``first``, then for its descendants re-parented to us (not our older children)."""
    code = first.wait()
    while rest := [c.pid for c in psutil.Process().children() if c.pid not in others_before]:
        for pid in rest:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    return code


def run_trainer_node(plan: LaunchPlan, alloc: Allocation, node_rank: int, *,
                     checkpoint_file: pathlib.Path | None = None) -> int:
    """Run torchrun for this node (its ranks wait for the engines); returns its exit status.

    Once ``checkpoint_file`` exists, this node's ranks get SIGUSR1 (checkpoint and exit).
    """
    engine_urls, router_url = endpoints(plan, alloc)
    argv = lp.trainer_argv(plan, python=sys.executable, node_rank=node_rank, master_addr=alloc.train_addrs[0],
                           master_port=alloc.port_base + net.MASTER_PORT_OFFSET,
                           layout_overrides=lp.rollout_overrides(engine_urls, router_url),
                           wait_for=engine_urls + ([router_url] if router_url else []),
                           local_addr=alloc.train_addrs[node_rank])
    env = node_env(plan, alloc, alloc.train_addrs[node_rank])
    log.info("trainer node %d: %s", node_rank, " ".join(argv))
    _become_subreaper()
    others = {c.pid for c in psutil.Process().children()}
    # torchrun would die on a stray SIGUSR1 and the step would take the ranks down with it.
    proc = subprocess.Popen(argv, env=env, preexec_fn=_ignore_checkpoint_signals)
    if checkpoint_file is not None:
        threading.Thread(target=_forward_checkpoint_request, args=(proc, checkpoint_file), daemon=True,
                         name="checkpoint-request").start()
    code = _reap_all(proc, others)
    log.info("trainer node %d: torchrun exited with %d", node_rank, code)
    return code


def _forward_checkpoint_request(torchrun: subprocess.Popen, request: pathlib.Path) -> None:
    """SIGUSR1 to the ranks (torchrun's children) only, once ``request`` appears.

    Not step-wide: Slurm would also hit the ranks' own helper processes (multiprocessing
    managers used by the checkpoint writer), which die on SIGUSR1 and break the save.
    """
    while torchrun.poll() is None:
        if request.exists():
            try:
                ranks = psutil.Process(torchrun.pid).children()
            except psutil.NoSuchProcess:
                return
            log.info("checkpoint requested: SIGUSR1 to ranks %s", [r.pid for r in ranks])
            for rank in ranks:
                try:
                    rank.send_signal(signal.SIGUSR1)
                except psutil.NoSuchProcess:
                    pass
            return
        time.sleep(1.0)


def checkpoint_request_path(run_dir: str, alloc: Allocation) -> pathlib.Path:
    """Touching it asks every trainer node of this run of the job to checkpoint and exit."""
    return pathlib.Path(run_dir) / "launch" / f"checkpoint-{alloc.job_id}-{alloc.restart}"


def _start(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    log.info("starting: %s", " ".join(argv))
    return subprocess.Popen(argv, env=env, preexec_fn=_ignore_checkpoint_signals)


def _stop_all(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``: engines hold no state worth a longer wait."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@dataclass(slots=True)
class ServedEngine:
    """One engine server this node runner keeps alive."""

    argv: list[str]
    url: str
    env: dict[str, str] | None
    proc: subprocess.Popen
    restarts: int = 0
    answered: bool = False
    """It answered /model_info since its (re)start: silence from now on means hung, not loading."""
    silent: int = 0
    failed: bool = False
    """Down for good: its restart budget is spent."""

    def why_dead(self, http: httpx.Client) -> str:
        """'' while alive; else why it counts as dead (exited, or hung after it had answered)."""
        if self.proc.poll() is not None:
            return f"exited with {self.proc.returncode}"
        try:
            ok = http.get(self.url + "/model_info", timeout=PROBE_TIMEOUT_S).status_code == 200
            self.answered, self.silent = self.answered or ok, 0
        except httpx.HTTPError:
            if self.answered:  # before its first answer it may still be loading its weights
                self.silent += 1
        return f"hung: no answer to /model_info on {self.silent} checks" if self.silent >= HANG_PROBES else ""


def keep_engines(engines: list[ServedEngine], http: httpx.Client, *, budget: int) -> None:
    """One round: kill and restart (same port) every engine that exited or hung, within ``budget``."""
    for e in engines:
        why = "" if e.failed else e.why_dead(http)
        if not why:
            continue
        _stop_all([e.proc], grace_s=0.0)  # SIGKILL after no grace: also ends a stopped process
        if e.restarts >= budget:
            log.error("engine %s %s; its restart budget (rollout.engine_restart_budget=%d) is spent: it stays down",
                      e.url, why, budget)
            e.failed = True
            continue
        e.restarts += 1
        log.warning("engine %s %s: restart %d of %d", e.url, why, e.restarts, budget)
        e.proc, e.answered, e.silent = _start(e.argv, env=e.env), False, 0


def run_rollout_node(plan: LaunchPlan, alloc: Allocation, node_index: int, *, stop: threading.Event,
                     stop_file: pathlib.Path | None = None) -> int:
    """Serve this node's engines (and the router on rollout node 0) until ``stop`` or the stop file."""
    from sao_megatron.config import load_config
    from sao_megatron.launch import engine_init

    model_dir = engine_init.prepare(plan)
    rollout = load_config(plan.config, plan.overrides, check=False).rollout
    per_node = lp.engines_per_node(plan)
    host = alloc.rollout_addrs[node_index]
    env = node_env(plan, alloc, host)
    mine = lp.engine_endpoints(alloc.rollout_addrs, alloc.port_base, per_node)[node_index * per_node:][:per_node]
    python, extra, engine_env = _engine_setup(plan, rollout, model_dir, env)
    engines = []
    for k, (addr, port) in enumerate(mine):
        argv = lp.engine_argv(plan, python=python, model_dir=model_dir, host=host, port=port, local_index=k,
                              return_routed_experts=rollout.routing_replay, api_key=rollout.api_key)
        argv[len(argv) - len(plan.engine_args):len(argv) - len(plan.engine_args)] = extra  # --engine-arg wins
        engines.append(ServedEngine(argv, lp.url(addr, port), engine_env, _start(argv, env=engine_env)))
    procs: list[subprocess.Popen] = []  # the router, on rollout node 0
    try:
        engine_urls, router_url = endpoints(plan, alloc)
        if router_url and node_index == 0:
            wait_healthy(engine_urls, timeout_s=ENGINE_START_TIMEOUT_S,
                         alive=lambda: all(e.proc.poll() is None for e in engines))
            rhost, rport = lp.router_endpoint(alloc.rollout_addrs, alloc.port_base)
            argv = lp.router_argv(python=sys.executable, host=rhost, port=rport, worker_urls=engine_urls,
                                  model_dir=model_dir, request_timeout_s=rollout.request_timeout_s,
                                  api_key=rollout.api_key)
            procs.append(_start(argv, env=dict(env, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")))
        with httpx.Client(trust_env=False, headers=headers_for(rollout.api_key)) as http:
            return _serve(procs, stop, stop_file,
                          keep=lambda: keep_engines(engines, http, budget=rollout.engine_restart_budget),
                          engines=engines)
    finally:
        _stop_all(procs + [e.proc for e in engines])


def _engine_setup(plan: LaunchPlan, rollout, model_dir: str, env: dict[str, str]) -> tuple[str, list[str], dict[str, str]]:
    """(python, arguments, environment) of this node's engine servers.

    SGLang servers get the arguments of those the trainer starts itself (``rollout.launch``: the
    checkpoint's dtype, rollout.sglang_max_total_tokens, no warm-up) and run on SGLang's own venv when
    rollout.sglang_python or $SAO_SGLANG_PYTHON names one (else this python, e.g. a GPU container's
    with sglang installed). On a node without GPUs they run with the CPU support of rollout.sglang_cpu.
    """
    if lp.server_kind(plan) != "sglang":
        return sys.executable, [], env
    from sao_megatron.rollout import sglang_cpu
    from sao_megatron.rollout.launch import sglang_python, sglang_server_args

    python = sys.executable
    if rollout.sglang_python or os.environ.get("SAO_SGLANG_PYTHON"):
        python = sglang_python(rollout.sglang_python)
    device = "cuda" if plan.gpus_per_node else "cpu"
    extra = sglang_server_args(model_dir, max_total_tokens=rollout.sglang_max_total_tokens, device=device)
    return python, extra, sglang_cpu.cpu_env(env) if device == "cpu" else env


def _serve(procs: list[subprocess.Popen], stop: threading.Event, stop_file: pathlib.Path | None, *,
           keep=lambda: None, engines: list[ServedEngine] = ()) -> int:
    """Until ``stop`` or the stop file; ``keep()`` restarts engines each round. 1 if the router exits or
    every engine of this node is down for good."""
    while not stop.wait(1.0):
        if stop_file is not None and stop_file.exists():
            log.info("stop file %s present: shutting the engines down", stop_file)
            return 0
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            log.error("server exited with %d: %s", dead[0].returncode, " ".join(map(str, dead[0].args)))
            return 1
        keep()
        if engines and all(e.failed for e in engines):
            log.error("every engine of this node is down and out of restarts")
            return 1
    return 0


def stop_file_path(run_dir: str, alloc: Allocation) -> pathlib.Path:
    """Written when training ends, so the rollout nodes of that run of the job shut down."""
    return pathlib.Path(run_dir) / "launch" / f"stop-{alloc.job_id}-{alloc.restart}"


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``sao-megatron launch`` and the node runner (names match LaunchPlan)."""
    from sao_megatron.config.cli import add_config_args

    add_config_args(p)
    p.add_argument("--run-dir", required=True, help="run directory on a shared file system")
    p.add_argument("--nodes-train", type=int, default=1, help="trainer nodes (default 1)")
    p.add_argument("--nodes-rollout", type=int, default=1, help="rollout nodes (default 1; 0 = none)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (default 0: CPU)")
    p.add_argument("--procs-per-node", type=int, default=None, help="trainer processes per node "
                   "(default: GPUs per node, 1 on CPU)")
    p.add_argument("--gpus-per-engine", type=int, default=None, help="GPUs (TP) per SGLang server "
                   "(default: all GPUs of a node)")
    p.add_argument("--server", choices=["auto", "sglang", "embedded"], default="auto",
                   help="engine server on rollout nodes (auto: sglang with GPUs, embedded without)")
    p.add_argument("--engine-model-dir", default=None, help="weights the engines load (default model.hf_dir)")
    p.add_argument("--engine-arg", dest="engine_args", action="append", default=[],
                   help="extra argument for every engine server (repeatable)")
    p.add_argument("--router", choices=["auto", "sglang_router", "none"], default="auto",
                   help="sglang-router in front of the engines (auto: with more than one engine)")
    p.add_argument("--shutdown-timeout", dest="shutdown_timeout_s", type=int, default=600,
                   help="seconds ranks get to finish a checkpoint after a signal (default 600)")
    p.add_argument("--iface", default=network.AUTO,
                   help="network interface for gloo and NCCL on every node, e.g. eth0 or ib0 (sets "
                        "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME; default auto: the interface that "
                        "carries the node's Slurm NodeAddr)")


def plan_from_args(args: argparse.Namespace, **extra) -> LaunchPlan:
    return LaunchPlan(config=os.path.abspath(args.config), overrides=list(args.overrides),
                      run_dir=os.path.abspath(args.run_dir), nodes_train=args.nodes_train,
                      nodes_rollout=args.nodes_rollout, gpus_per_node=args.gpus_per_node,
                      procs_per_node=args.procs_per_node, gpus_per_engine=args.gpus_per_engine,
                      server=args.server, engine_model_dir=args.engine_model_dir,
                      engine_args=list(args.engine_args), router=args.router,
                      shutdown_timeout_s=args.shutdown_timeout_s, iface=args.iface, **extra)


def _add_node_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("role", choices=["train", "rollout"])
    add_plan_args(p)
    p.add_argument("--stop-file", type=pathlib.Path, default=None,
                   help="rollout: shut the engines down once this file exists")
    p.add_argument("--checkpoint-file", type=pathlib.Path, default=None,
                   help="train: SIGUSR1 to the ranks (checkpoint and exit) once this file exists")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``sao-megatron node``: what slurm/sao_rl.sbatch runs on each node through srun."""
    p = sub.add_parser("node", help="run this node's part of a launched layout (called by srun)",
                       description="Run this node's part of a launched layout (called by srun).")
    _add_node_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan = plan_from_args(args)
    alloc = allocation_from_slurm(plan)
    index = int(os.environ.get("SLURM_NODEID", "0"))
    stop = threading.Event()
    if args.role == "train":
        # Slurm signals every process of the step: the ranks get it themselves, and this
        # runner must outlive them (its exit would end the step and kill them mid-save).
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, lambda s, f: log.info("trainer node: got %s (the ranks got it too)",
                                                     signal.Signals(s).name))
        return run_trainer_node(plan, alloc, index, checkpoint_file=args.checkpoint_file)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: stop.set())
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    return run_rollout_node(plan, alloc, index, stop=stop, stop_file=args.stop_file)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sao_megatron.launch.node",
                                     description="Run this node's part of a launched layout (called by srun).")
    _add_node_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s launch.node: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
