"""Train/inference log-prob parity gate: engine log-probs vs the Megatron actor on the same tokens.

The actor's weights are exported exactly as the trainer syncs them (HF names,
safetensors), an engine serves them, generates from task prompts, and the
Megatron actor recomputes the log-prob of every generated token. The gap is the
train/inference mismatch that DIS then sees as an importance ratio: it must be
tiny in fp32, and ``sao-megatron parity`` exits non-zero above ``--tol``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import pathlib
import random
from typing import TYPE_CHECKING

import torch

from sao_megatron.config import ModelConfig
from sao_megatron.config.schema import RolloutConfig
from sao_megatron.config.cli import add_config_args
from sao_megatron.errors import SaoError

if TYPE_CHECKING:
    from sao_megatron.training.run.components import Components

log = logging.getLogger(__name__)


def measure_parity(c: Components, model: ModelConfig, run_dir: pathlib.Path, *, num_prompts: int,
                   max_new_tokens: int, temperature: float, seed: int,
                   engine_urls: list[str] | None = None, rollout: RolloutConfig | None = None) -> dict[str, float]:
    """Collective over the trainer's world; returns the gap statistics (on every rank).

    With routing replay attached to the actor (``rollout.routing_replay``), the engine is asked for
    routed experts and the gap is measured twice: ``parity/*`` with replay (what training uses) and
    ``parity/no_replay_*`` with the trainer's own routing, plus ``parity/route_mismatch_frac``.
    """
    from sao_megatron.models.routing_replay import find_route_replay

    replay = find_route_replay(c.actor.chunks[0]) is not None
    pairs = generate_pairs(c, model, run_dir, num_prompts=num_prompts, max_new_tokens=max_new_tokens,
                           temperature=temperature, seed=seed, engine_urls=engine_urls, routes=replay,
                           rollout=rollout)
    return parity_gaps(c, pairs, vocab_size=model.vocab_size, temperature=temperature, replay=replay)


def generate_pairs(c: Components, model: ModelConfig, run_dir: pathlib.Path, *, num_prompts: int,
                   max_new_tokens: int, temperature: float, seed: int, engine_urls: list[str] | None = None,
                   routes: bool = False, rollout: RolloutConfig | None = None) -> list[tuple]:
    """Collective: export the actor, generate from task prompts (rank 0), and give every rank
    ``(prompt ids, output ids, engine log-probs, routed experts or None)`` per prompt. Without
    ``engine_urls`` one engine of ``rollout.engine``'s kind is started (embedded by default; a real
    SGLang server for ``rollout.engine=sglang``)."""
    from sao_megatron.parallel.collectives import broadcast_object, rank0_call
    from sao_megatron.rollout.types import SamplingParams
    from sao_megatron.training.run.components import write_hf_export

    out_dir = run_dir / "parity_weights"
    write_hf_export(c, model, out_dir, run_dir / "hf_template")
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=True,
                              sampling_seed=seed)
    pairs = rank0_call(lambda: _generate(c.task, out_dir, run_dir, sampling, num_prompts, seed, engine_urls,
                                         routes=routes, rollout=rollout))
    return broadcast_object(pairs)


def parity_gaps(c: Components, pairs: list[tuple], *, vocab_size: int, temperature: float,
                replay: bool) -> dict[str, float]:
    """Collective: |trainer − engine| log-prob statistics over the generated tokens of ``pairs``
    ``(prompt ids, output ids, engine log-probs, routed experts [rows, ...] or None)``."""
    from sao_megatron.models.routing_replay import route_metrics

    mb = _parity_batch(pairs, c.ctx.tp_size, c.ctx.device)
    plain = {k: v for k, v in mb.items() if k in ("tokens",)}
    stats = _gaps(c, pairs, plain, vocab_size, temperature)
    if not replay:
        return stats
    route_metrics(c.actor.chunks, device=c.ctx.device)  # drop counts of earlier forwards
    replayed = _gaps(c, pairs, mb, vocab_size, temperature)
    mismatch = route_metrics(c.actor.chunks, device=c.ctx.device).get("rollout/route_mismatch_frac", 0.0)
    return {**replayed, **{k.replace("parity/", "parity/no_replay_"): v for k, v in stats.items()
                           if k != "parity/num_tokens"}, "parity/route_mismatch_frac": mismatch}


def _parity_batch(pairs: list[tuple], tp_size: int, device) -> dict[str, torch.Tensor]:
    """One micro-batch: tokens [b, s] (s a multiple of the TP size) and, when every pair has routes,
    routed_experts/route_valid as ``scheduler.sample.collate`` builds them."""
    from sao_megatron.scheduler.sample import Sample, collate

    samples = [Sample(prompt_ids=list(p), response_ids=list(o), action_mask=[1] * len(o), rollout_logprobs=list(e),
                      versions=[0] * len(o), routed_experts=r) for p, o, e, r in pairs]
    full = collate(samples, pad_to_multiple=tp_size)
    return {k: full[k].to(device) for k in ("tokens", "routed_experts", "route_valid") if k in full}


def _gaps(c: Components, pairs, mb, vocab_size: int, temperature: float) -> dict[str, float]:
    from sao_megatron.training.step.forward import compute_logprobs

    lp = compute_logprobs(c.actor.chunks, [mb], ctx=c.ctx, vocab_size=vocab_size, temperature=temperature)[0].cpu()
    gaps = torch.cat([(lp[i, len(p):len(p) + len(o)] - torch.tensor(e, dtype=lp.dtype)).abs()
                      for i, (p, o, e, _) in enumerate(pairs)])
    return {"parity/mean_abs": float(gaps.mean()), "parity/max_abs": float(gaps.max()),
            "parity/num_tokens": float(gaps.numel())}


def _generate(task, model_dir, run_dir, sampling, num_prompts, seed, engine_urls, *, routes: bool = False,
              rollout: RolloutConfig | None = None):
    """(prompt ids, output ids, engine log-probs, routed experts or None) per chosen prompt."""
    from sao_megatron.rollout.client import RolloutClient
    from sao_megatron.rollout.launch import LocalEngines, local_sglang_engines
    from sao_megatron.rollout.async_bridge import AsyncBridge

    prompts = task.prompts()
    chosen = random.Random(seed).sample(prompts, min(num_prompts, len(prompts)))
    flags = ["--enable-return-routed-experts"] if routes else []
    if engine_urls:
        engines = None
    elif rollout is not None and rollout.engine == "sglang":
        engines = local_sglang_engines(dataclasses.replace(rollout, num_engines=1), model_dir,
                                       log_dir=run_dir / "logs", extra_args=["--skip-tokenizer-init", *flags])
    else:
        engines = LocalEngines(model_dir, 1, log_dir=run_dir / "logs", extra_args=flags)
    bridge = AsyncBridge()
    try:
        urls = engine_urls or engines.start()
        client = RolloutClient(urls)

        async def run_all():
            import asyncio

            try:
                return await asyncio.gather(*(client.generate(p.input_ids, sampling, return_routed_experts=routes)
                                              for p in chosen))
            finally:
                await client.aclose()

        results = bridge.run(run_all())
    finally:
        bridge.close()
        if engines is not None:
            engines.stop()
    return [(p.input_ids, r.output_ids, r.logprobs, r.routed_experts) for p, r in zip(chosen, results)]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("parity", help="engine vs Megatron actor log-prob gap on generated tokens (mismatch gate)")
    add_config_args(p)
    p.add_argument("--run-dir", required=True, help="scratch directory (weights, engine logs, result JSON)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--engine-url", action="append", default=None,
                   help="measure against a running engine serving these weights instead of starting one")
    p.add_argument("--tol", type=float, default=1e-4, help="max |Δlogprob| allowed (exit 1 above)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from sao_megatron.config import load_config
    from sao_megatron.parallel.bootstrap import destroy
    from sao_megatron.training.run.components import build_components, initial_weights

    cfg = load_config(args.config, ["run.sft_steps=0", *args.overrides])
    run_dir = pathlib.Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    c = build_components(cfg, with_critic=False)  # the gate needs the policy only
    try:
        initial_weights(c, cfg)
        stats = measure_parity(c, cfg.model, run_dir, num_prompts=args.num_prompts, seed=cfg.run.seed,
                               max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               engine_urls=args.engine_url, rollout=cfg.rollout)
    finally:
        rank0 = dist.get_rank() == 0  # asked before the process group is gone
        destroy()
    if rank0:
        (pathlib.Path(args.run_dir) / "parity.json").write_text(json.dumps(stats, indent=2))
        log.info("log-prob parity over %d tokens: mean |Δ| %.3g, max |Δ| %.3g (tol %.3g)",
                 stats["parity/num_tokens"], stats["parity/mean_abs"], stats["parity/max_abs"], args.tol)
        if "parity/no_replay_max_abs" in stats:
            log.info("without routing replay: mean |Δ| %.3g, max |Δ| %.3g; routes differing %.3g of (token, layer)",
                     stats["parity/no_replay_mean_abs"], stats["parity/no_replay_max_abs"],
                     stats["parity/route_mismatch_frac"])
    if stats["parity/max_abs"] > args.tol:
        raise SaoError(f"log-prob gap {stats['parity/max_abs']:.3g} exceeds --tol {args.tol:g}: the engine and "
                       "the trainer disagree (weights, dtype, rope/norm settings or sampling temperature)")
    return 0
