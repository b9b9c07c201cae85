"""Helpers for the tests on the local Slurm cluster: submitting, job states, run-dir checks."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
CLUSTER = REPO / "scripts" / "slurm_cluster.sh"
SBATCH = REPO / "slurm" / "sao_rl.sbatch"
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}

# The tiny CPU job, cut down so that one run takes about a minute on two shared cores.
TINY_OVERRIDES = {
    "run": {"num_steps": 6, "sft_steps": 2},
    "critic": {"pretrain_steps": 1},
    "scheduler": {"batch_size": 8, "concurrency": 16},
    "checkpoint": {"save_interval": 2, "keep_last": 2},
    "logging": {"log_interval": 1},
}


def write_tiny_config(path: pathlib.Path, **sections: dict) -> pathlib.Path:
    """configs/experiments/tiny_cpu.yaml with the test's shorter schedule (``sections`` override it)."""
    tree = {"_base_": str(REPO / "configs" / "experiments" / "tiny_cpu.yaml")}
    for name in {**TINY_OVERRIDES, **sections}:
        tree[name] = {**TINY_OVERRIDES.get(name, {}), **sections.get(name, {})}
    path.write_text(json.dumps(tree))  # JSON is YAML
    return path


def submit_sbatch(run_dir: pathlib.Path, config: pathlib.Path, *extra: str, nodes: int = 2,
                  env: dict[str, str] | None = None, sbatch_args: tuple[str, ...] = ()) -> str:
    """Submit slurm/sao_rl.sbatch (1 rollout node, the rest trainer) from the repo root; returns the job id."""
    run_dir.mkdir(parents=True, exist_ok=True)  # Slurm opens --output but creates no directories
    job_env = {**os.environ, "CONFIG": str(config), "RUN_DIR": str(run_dir), "NODES_ROLLOUT": "1",
               "PYTHON": sys.executable, **(env or {})}
    out = subprocess.run(["sbatch", "--parsable", f"--nodes={nodes}", "--time=20", *sbatch_args,
                          f"--output={run_dir}/slurm-%j.out", str(SBATCH), *extra],
                         cwd=REPO, env=job_env, capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip().split(";")[0]


# The multi-host layout: trainer nodes 0-1 run torchrun with 2 ranks each, TP2 inside a node x DP2
# across the two nodes (gloo between them); the last node runs the engine and the router.
MULTIHOST_NODES = 3
MULTIHOST_ENV = {"PROCS_PER_NODE": "2", "ROUTER": "sglang_router"}
MULTIHOST_PARALLEL = {"tensor_model_parallel_size": 2, "sequence_parallel": True}


def write_multihost_config(path: pathlib.Path, **sections: dict) -> pathlib.Path:
    parallel = {**MULTIHOST_PARALLEL, **sections.pop("parallel", {})}
    return write_tiny_config(path, parallel=parallel, **sections)


def submit_multihost(run_dir: pathlib.Path, config: pathlib.Path, env: dict[str, str] | None = None) -> str:
    return submit_sbatch(run_dir, config, nodes=MULTIHOST_NODES, env={**MULTIHOST_ENV, **(env or {})})


def node_addrs() -> dict[str, str]:
    """NodeName -> NodeAddr of every node of the cluster."""
    out = subprocess.run(["scontrol", "show", "node", "-o"], capture_output=True, text=True, check=True, timeout=60)
    fields = [dict(t.split("=", 1) for t in line.split() if "=" in t) for line in out.stdout.splitlines()]
    return {f["NodeName"]: f["NodeAddr"] for f in fields if "NodeName" in f}


def job_nodes(info: dict[str, str]) -> list[str]:
    """The job's nodes in ``scontrol show hostnames`` order (the layout's order)."""
    out = subprocess.run(["scontrol", "show", "hostnames", info["NodeList"]], capture_output=True, text=True,
                         check=True, timeout=60)
    return out.stdout.split()


def job_info(job_id: str) -> dict[str, str]:
    """``scontrol show job`` fields (completed jobs stay listed for MinJobAge = 600 s)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    return dict(tok.split("=", 1) for tok in out.stdout.split() if "=" in tok)


def wait_for_state(job_id: str, states: set[str], timeout_s: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = job_info(job_id)
        if info.get("JobState") in states:
            return info
        time.sleep(1.0)
    raise AssertionError(f"job {job_id} not in {states} after {timeout_s:.0f} s: {info.get('JobState')}")


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def latest_checkpoint(run_dir: pathlib.Path) -> pathlib.Path | None:
    latest = run_dir / "checkpoints" / "latest"
    if not latest.is_file():
        return None
    path = run_dir / "checkpoints" / latest.read_text().strip()
    return path if (path / "trainer_state.json").is_file() else None


def read_jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_run_complete(run_dir: pathlib.Path, num_steps: int) -> dict:
    """Metrics for every step up to ``num_steps`` and a final checkpoint at it; returns its trainer state."""
    steps = {row["step"] for row in read_jsonl(run_dir / "metrics.jsonl") if "step" in row}
    assert len(steps) >= num_steps, f"metrics.jsonl has steps {sorted(steps)}, expected {num_steps}"
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None, f"no checkpoint under {run_dir / 'checkpoints'}"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == num_steps
    assert (ckpt / "actor").is_dir()
    return state


def assert_exactly_once(run_dir: pathlib.Path, trainer_state: dict) -> None:
    """Every prompt the data cursor handed out is trained once, or still owed (re-queued or buffered).

    Reference: replay the cursor's deterministic order up to its final position; the trained
    samples in audit.jsonl, the re-queued prompts and the finished-but-untrained FIFO must
    partition exactly that set. A lost prompt leaves a hole, a duplicate shows up twice.
    """
    from sao_megatron.scheduler.prompts import PromptCursor

    sched = trainer_state["scheduler"]
    cur = sched["cursor"]
    reference = PromptCursor(cur["num_prompts"], seed=cur["seed"], shuffle=cur["shuffle"])
    dispatched = collections.Counter()
    while (reference.epoch, reference.position) != (cur["epoch"], cur["position"]):
        ref = reference.next()
        dispatched[(ref.epoch, ref.index)] += 1
    trained = collections.Counter((row["epoch"], row["index"]) for row in read_jsonl(run_dir / "audit.jsonl")
                                  if row.get("phase") != "sft")
    owed = collections.Counter((e, i) for e, i, _attempt in cur["requeued"])
    owed += collections.Counter((s["epoch"], s["index"]) for unit in sched["fifo"] for s in unit)
    twice = {k: v for k, v in (trained + owed).items() if v > 1}
    assert not twice, f"prompts trained or owed more than once: {sorted(twice.items())[:10]}"
    lost = set(dispatched) - set(trained) - set(owed)
    assert not lost, f"prompts handed out but never trained nor re-queued: {sorted(lost)[:10]}"
    assert set(trained) | set(owed) == set(dispatched)


EPHEMERAL_SYSCTL = "/proc/sys/net/ipv4/ip_local_port_range"


def node_netns(node: str) -> pathlib.Path | None:
    """The network namespace of an emulated node (None in the loopback fallback: the host's network)."""
    path = pathlib.Path("/run/netns") / f"sao-{node}"
    return path if path.exists() else None


def node_ephemeral_range(node: str) -> tuple[int, int]:
    """net.ipv4.ip_local_port_range as processes on ``node`` see it (it is per network namespace)."""
    ns = node_netns(node)
    cmd = ["nsenter", f"--net={ns}", "--", "cat", EPHEMERAL_SYSCTL] if ns else ["cat", EPHEMERAL_SYSCTL]
    low, high = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout.split()
    return int(low), int(high)


def set_node_ephemeral_range(node: str, ephemeral: tuple[int, int]) -> None:
    """Set the range inside the node's namespace only (never on the host: the loopback fallback refuses)."""
    ns = node_netns(node)
    assert ns is not None, f"{node} has no namespace of its own: changing the range would change the host's"
    write = f'echo "{ephemeral[0]} {ephemeral[1]}" > {EPHEMERAL_SYSCTL}'
    subprocess.run(["nsenter", f"--net={ns}", "--", "sh", "-c", write], check=True, timeout=60)
    assert node_ephemeral_range(node) == ephemeral
