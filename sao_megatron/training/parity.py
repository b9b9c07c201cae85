"""Train/inference log-prob parity gate: engine log-probs vs the Megatron actor on the same tokens.

The actor's weights are exported exactly as the trainer syncs them (HF names,
safetensors), an engine serves them, generates from task prompts, and the
Megatron actor recomputes the log-prob of every generated token. The gap is the
train/inference mismatch that DIS then sees as an importance ratio: it must be
tiny in fp32, and ``sao-megatron parity`` exits non-zero above ``--tol``.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import random

import torch

from sao_megatron.config.cli import add_config_args
from sao_megatron.errors import SaoError

log = logging.getLogger(__name__)


def measure_parity(trainer, *, num_prompts: int, max_new_tokens: int, temperature: float,
                   engine_urls: list[str] | None = None) -> dict[str, float]:
    """Collective over the trainer's world; returns the gap statistics (on every rank)."""
    from sao_megatron.rollout.types import SamplingParams
    from sao_megatron.training.collectives import broadcast_object, rank0_call
    from sao_megatron.training.forward import compute_logprobs
    from sao_megatron.training.rollout_side import write_hf_template

    out_dir = trainer.run_dir / "parity_weights"
    gen = trainer._export()

    def write() -> None:
        from sao_megatron.rollout.weight_sync import write_hf_safetensors

        try:
            template = write_hf_template(trainer.cfg.model, trainer.task, trainer.run_dir / "hf_template")
            write_hf_safetensors(gen, out_dir, template_dir=template)
        finally:
            trainer._drain(gen)

    rank0_call(write, others=lambda: trainer._drain(gen))
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, ignore_eos=True,
                              sampling_seed=trainer.cfg.run.seed)
    pairs = rank0_call(lambda: _generate(trainer, out_dir, sampling, num_prompts, engine_urls))
    pairs = broadcast_object(pairs)
    width = max(len(p) + len(o) for p, o, _ in pairs)
    width = -(-width // trainer.ctx.tp_size) * trainer.ctx.tp_size
    tokens = torch.zeros(len(pairs), width, dtype=torch.long)
    for i, (p, o, _) in enumerate(pairs):
        tokens[i, :len(p) + len(o)] = torch.tensor(p + o)
    lp = compute_logprobs(trainer.actor.chunks, [{"tokens": tokens}], ctx=trainer.ctx,
                          vocab_size=trainer.cfg.model.vocab_size, temperature=temperature)[0]
    gaps = torch.cat([(lp[i, len(p):len(p) + len(o)] - torch.tensor(e, dtype=lp.dtype)).abs()
                      for i, (p, o, e) in enumerate(pairs)])
    return {"parity/mean_abs": float(gaps.mean()), "parity/max_abs": float(gaps.max()),
            "parity/num_tokens": float(gaps.numel())}


def _generate(trainer, model_dir, sampling, num_prompts, engine_urls):
    from sao_megatron.rollout.client import RolloutClient
    from sao_megatron.rollout.launch import LocalEngines
    from sao_megatron.training.async_bridge import AsyncBridge

    prompts = trainer.task.prompts()
    chosen = random.Random(trainer.cfg.run.seed).sample(prompts, min(num_prompts, len(prompts)))
    engines = None if engine_urls else LocalEngines(model_dir, 1, log_dir=trainer.run_dir / "logs")
    bridge = AsyncBridge()
    try:
        urls = engine_urls or engines.start()
        client = RolloutClient(urls)

        async def run_all():
            import asyncio

            try:
                return await asyncio.gather(*(client.generate(p.input_ids, sampling) for p in chosen))
            finally:
                await client.aclose()

        results = bridge.run(run_all())
    finally:
        bridge.close()
        if engines is not None:
            engines.stop()
    return [(p.input_ids, r.output_ids, r.logprobs) for p, r in zip(chosen, results)]


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
    from sao_megatron.training.trainer import Trainer

    cfg = load_config(args.config, ["run.sft_steps=0", *args.overrides])
    trainer = Trainer(cfg, pathlib.Path(args.run_dir), resume="never")
    try:
        trainer._initial_weights()
        stats = measure_parity(trainer, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, engine_urls=args.engine_url)
    finally:
        trainer.close()
    if dist.get_rank() == 0:
        (pathlib.Path(args.run_dir) / "parity.json").write_text(json.dumps(stats, indent=2))
        log.info("log-prob parity over %d tokens: mean |Δ| %.3g, max |Δ| %.3g (tol %.3g)",
                 stats["parity/num_tokens"], stats["parity/mean_abs"], stats["parity/max_abs"], args.tol)
    if stats["parity/max_abs"] > args.tol:
        raise SaoError(f"log-prob gap {stats['parity/max_abs']:.3g} exceeds --tol {args.tol:g}: the engine and "
                       "the trainer disagree (weights, dtype, rope/norm settings or sampling temperature)")
    return 0
