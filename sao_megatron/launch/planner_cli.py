"""`sao-megatron plan --config X.yaml [--nodes N --gpus-per-node 8 --gpu-mem-gb 141] [--json]`.

Checks the trainer and rollout layouts of a config against a cluster shape and
estimates per-GPU memory (see launch/planner.py for the memory model). Exit code
0 when the layout is valid and fits, 1 when it does not (the output says why and
suggests the smallest layout that fits), 2 for a config that does not load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from sao_megatron.config.cli import add_config_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="check a parallel layout and estimate per-GPU memory before launch")
    add_config_args(p)
    p.add_argument("--nodes", type=int, default=None, help="trainer nodes (default: resources.nodes)")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: resources.gpus_per_node")
    p.add_argument("--gpu-mem-gb", type=float, default=None, help="GiB per GPU, e.g. 80 (H100), 141 (H200)")
    p.add_argument("--rollout-nodes", type=int, default=None, help="default: resources.rollout_nodes")
    p.add_argument("--max-nodes", type=int, default=64, help="search limit for the suggested layout")
    p.add_argument("--nccl-gbps", type=float, default=40.0, help="weight-sync broadcast bandwidth, GB/s")
    p.add_argument("--disk-gbps", type=float, default=5.0, help="shared file system bandwidth, GB/s")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=run)


def with_cluster(cfg: Any, args: argparse.Namespace) -> Any:
    """The config with the command line's cluster shape (flags left unset keep the config's)."""
    given = {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "gpu_mem_gb": args.gpu_mem_gb,
             "rollout_nodes": args.rollout_nodes}
    return dataclasses.replace(cfg, resources=dataclasses.replace(
        cfg.resources, **{k: v for k, v in given.items() if v is not None}))


def run(args: argparse.Namespace) -> int:
    from sao_megatron.config import load_config
    from sao_megatron.config.validate import check_resources, check_training
    from sao_megatron.launch.planner import make_plan

    cfg = with_cluster(load_config(args.config, args.overrides, check=False), args)
    plan = make_plan(cfg, max_nodes=args.max_nodes, nccl_gbps=args.nccl_gbps, disk_gbps=args.disk_gbps)
    plan.errors += check_training(cfg) + check_resources(cfg.resources)
    if args.json:
        sys.stdout.write(json.dumps(plan_json(plan, args.config), indent=2) + "\n")
    else:
        print_plan(plan, cfg, args.config)
    return 0 if plan.fits else 1


def _gib(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def plan_json(plan: Any, config: str) -> dict[str, Any]:
    """One object: counts, fits, per-role per-GPU GiB, breakdowns, errors, suggestion, weight sync."""
    lay = plan.layout
    roles = {name: mem for name, mem in (("actor", plan.actor), ("critic", plan.critic)) if mem is not None}
    out = {
        "config": config, "fits": plan.fits, "errors": plan.errors, "notes": plan.notes,
        "total_params": plan.params.total, "active_params": plan.params.active,
        "critic_params": plan.critic_params.total if plan.critic_params else None,
        "param_groups": plan.params.groups,
        "layout": {**dataclasses.asdict(lay), "world": lay.world, "dp": lay.dp, "expert_dp": lay.expert_dp},
        "per_gpu_gib": {**{n: _gib(m.total_gib) for n, m in roles.items()},
                        "trainer_peak": _gib(plan.trainer_peak_gib), "trainer_budget": plan.budget_gib,
                        "rollout": _gib(plan.rollout.total_gib) if plan.rollout else None},
        "breakdown_gib": {n: {"stage": m.stage, "params": m.params, "trainable": m.trainable,
                              "weights": _gib(m.weights_gib), "grads": _gib(m.grads_gib),
                              "optimizer": _gib(m.optimizer_gib), "activations": _gib(m.activations_gib)}
                          for n, m in roles.items()},
        "rollout": dataclasses.asdict(plan.rollout) | {"fits": plan.rollout.fits} if plan.rollout else None,
        "suggestion": ({**dataclasses.asdict(plan.suggestion), "describe": plan.suggestion.describe()}
                       if plan.suggestion else None),
        "suggested_rollout_tp_size": plan.suggested_rollout_tp,
        "weight_sync": plan.weight_sync,
    }
    return out


def print_plan(plan: Any, cfg: Any, config: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    p = plan.params
    console.print(f"[bold]{config}[/]: {p.total / 1e9:.2f}B parameters, {p.active / 1e9:.2f}B active; "
                  f"trainer {plan.layout.describe()}, {cfg.resources.gpu_mem_gb:g} GiB per GPU")
    for err in plan.errors:
        console.print(f"[red]✘[/] {err}")
    if not plan.errors:
        console.print("[green]✔[/] divisibility and topology checks pass")
    for note in plan.notes:
        console.print(f"[cyan]i[/] {note}")
    table = Table(title="per-GPU memory (GiB)")
    for col in ("role", "stage", "params/GPU", "weights", "grads", "optimizer", "activations/KV", "total"):
        table.add_column(col, justify="right" if col != "role" else "left")
    for mem in (plan.actor, plan.critic):
        if mem is not None:
            table.add_row(mem.role, str(mem.stage), f"{mem.params / 1e9:.2f}B", f"{mem.weights_gib:.1f}",
                          f"{mem.grads_gib:.1f}", f"{mem.optimizer_gib:.1f}", f"{mem.activations_gib:.1f}",
                          f"{mem.total_gib:.1f}")
    if plan.actor is not None:
        mark = "green" if plan.trainer_peak_gib <= plan.budget_gib else "red"
        table.add_row("trainer peak", "", "", "", "", "", "", f"[{mark}]{plan.trainer_peak_gib:.1f} / "
                      f"{plan.budget_gib:g}[/]")
    r = plan.rollout
    if r is not None:
        mark = "green" if r.fits else "red"
        table.add_row(f"rollout ({r.servers} x TP{r.gpus_per_server})", "", "", f"{r.weights_gib:.1f}", "", "",
                      f"{r.kv_cache_gib:.1f}", f"[{mark}]{r.total_gib:.1f} / {r.budget_gib:.1f}[/]")
    console.print(table)
    if r is not None:
        console.print(f"rollout: {r.sequences_per_server} sequences x {cfg.data.max_total_tokens} tokens per "
                      f"server; KV capacity {r.kv_capacity_tokens:,} tokens per server")
    ws = plan.weight_sync
    console.print(f"weight sync per step: {ws['bytes'] / 1e9:.1f} GB bf16 -> NCCL broadcast "
                  f"~{ws['nccl_s']:.1f} s, "
                  f"via shared disk ~{ws['disk_s']:.0f} s")
    from sao_megatron.launch.sync_estimate import describe, estimate_sync

    console.print(describe(estimate_sync(cfg.model, cfg.parallel, cfg.resources)))
    if plan.suggestion is not None:
        console.print(f"smallest trainer layout that fits: {plan.suggestion.describe()}")
    else:
        console.print("[red]no trainer layout fits within --max-nodes[/]: enable full recompute, "
                      "resources.offload_idle_optimizer, or shorter micro-batches")
    if plan.suggested_rollout_tp is not None:
        console.print(f"smallest rollout server that fits: rollout_tp_size={plan.suggested_rollout_tp}")
    console.print(f"[bold]{'fits' if plan.fits else 'does NOT fit'}[/]")
