"""`sao-megatron models smoke --config X.yaml [--set k=v]`: build actor and critic, train a few steps.

Runs on one process or under torchrun (any layout the config's ``parallel`` section
describes). Prints parameter counts (trainable vs frozen) and the losses of a few
actor steps (-mean log-prob of random tokens) and critic steps (value regression).
"""

from __future__ import annotations

import argparse
import time

from sao_megatron.config.cli import add_config_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="Megatron model checks (smoke: build actor+critic, forward/backward)")
    p.add_argument("action", choices=["smoke"])
    add_config_args(p)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps for actor and critic (default 2)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sample (default 32)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import logging
    import warnings

    import torch.distributed as dist

    # Megatron logs every bucket's parameters at INFO and warns about apex/TE on CPU: keep the report readable.
    logging.getLogger("megatron").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module=r"megatron\..*")

    from sao_megatron.config import load_config
    from sao_megatron.parallel.bootstrap import destroy, init_distributed, launch_env

    cfg = load_config(args.config, args.overrides, world_size=launch_env().world_size)
    ctx = init_distributed(cfg.parallel, seed=cfg.run.seed, device=cfg.resources.device)
    try:
        rows, losses = _smoke(cfg, ctx, steps=args.steps, seq_len=args.seq_len)
        if dist.get_rank() == 0:
            _print_report(cfg, ctx, rows, losses)
    finally:
        destroy()
    return 0


def _microbatches(cfg, ctx, seq_len: int):
    import torch

    g = torch.Generator().manual_seed(cfg.run.seed + ctx.dp_rank)
    seq = -(-seq_len // ctx.tp_size) * ctx.tp_size  # sequence parallel needs a multiple of TP
    return [{"tokens": torch.randint(0, cfg.model.vocab_size, (2, seq), generator=g).to(ctx.device),
             "returns": torch.rand(2, seq, generator=g).to(ctx.device)} for _ in range(max(2, ctx.pp_size))]


def _smoke(cfg, ctx, *, steps: int, seq_len: int):
    from sao_megatron.models.actor import token_logprobs
    from sao_megatron.models.builder import build_model_chunks, count_parameters
    from sao_megatron.models.critic import freeze_for_critic, init_critic_from_actor, token_values
    from sao_megatron.training.step.optim import optimizer_step, setup_optimizer

    actor = build_model_chunks(cfg.model, ctx)
    critic = build_model_chunks(cfg.model, ctx, value_head=True)
    init_critic_from_actor(critic, actor)
    freeze_for_critic(critic, cfg.critic.trainable)
    rows = {"actor": count_parameters(actor), "critic": count_parameters(critic)}
    mbs = _microbatches(cfg, ctx, seq_len)
    num_tokens = sum(mb["tokens"][:, 1:].numel() for mb in mbs) * ctx.dp_size

    def actor_loss(logits, mb):
        lp, _ = token_logprobs(logits, mb["tokens"], tp_group=ctx.tp_group, vocab_size=cfg.model.vocab_size,
                               with_entropy=False)
        loss = -lp[:, 1:].sum() / num_tokens
        return loss, {"loss": loss.detach()}

    def critic_loss(values, mb):
        loss = 0.5 * ((token_values(values) - mb["returns"])[:, 1:] ** 2).sum() / num_tokens
        return loss, {"loss": loss.detach()}

    losses = {}
    for name, chunks, loss_fn, opt in (("actor", actor, actor_loss, cfg.actor.optimizer),
                                       ("critic", critic, critic_loss, cfg.critic.optimizer)):
        ddp, optimizer, scheduler = setup_optimizer(chunks, opt, ctx, total_steps=steps)
        start = time.perf_counter()
        losses[name] = [optimizer_step(ddp, optimizer, scheduler, mbs, loss_fn, ctx=ctx).loss for _ in range(steps)]
        losses[name + "_s_per_step"] = (time.perf_counter() - start) / max(steps, 1)
    return rows, losses


def _print_report(cfg, ctx, rows, losses) -> None:
    from rich.console import Console
    from rich.table import Table

    layout = (f"TP{ctx.tp_size} PP{ctx.pp_size} EP{ctx.ep_size} DP{ctx.dp_size}"
              f"{' SP' if cfg.parallel.sequence_parallel else ''}")
    table = Table(title=f"models smoke: {cfg.model.family}, {cfg.model.num_layers} layers, "
                        f"{cfg.model.num_moe_experts} experts, {layout} (parameters of rank 0)")
    for col in ("model", "parameters", "trainable", "frozen", "loss per step", "s/step"):
        table.add_column(col, justify="right" if col != "model" else "left")
    for name in ("actor", "critic"):
        c = rows[name]
        table.add_row(name, f"{c['total']:,}", f"{c['trainable']:,}", f"{c['frozen']:,}",
                      " → ".join(f"{x:.4f}" for x in losses[name]), f"{losses[name + '_s_per_step']:.2f}")
    Console().print(table)
