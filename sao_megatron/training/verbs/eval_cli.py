"""`sao-megatron eval --config X --checkpoint C [--samples N --temperature T]`: held-out accuracy.

``C`` is a trainer checkpoint (``RUN_DIR/checkpoints/step_N``: its actor is exported to Hugging
Face safetensors exactly as the trainer syncs weights) or an exported HF weight directory
(``RUN_DIR/weights/vNNNNNN``, served as is). An embedded engine serves the weights; the task's
held-out problems (``Task.heldout_prompts``) are evaluated one sample each and the result is
printed as pass@1 and mean reward with 95 % confidence intervals (``training.run.evaluation``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import pathlib
import sys

from sao_megatron.config.cli import add_config_args

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="pass@1 and mean reward (95%% CI) of a checkpoint on held-out problems")
    add_config_args(p)
    p.add_argument("--checkpoint", required=True,
                   help="RUN_DIR/checkpoints/step_N (Megatron) or an exported HF dir (RUN_DIR/weights/vNNNNNN)")
    p.add_argument("--samples", type=int, default=None, help="held-out problems (default eval.num_prompts)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default eval.temperature)")
    p.add_argument("--work-dir", default=None, help="scratch for exported weights and engine logs "
                   "(default: CHECKPOINT/../eval_<name>)")
    p.add_argument("--json", default=None, help="also write the metrics to this JSON file")
    p.set_defaults(func=_run)


def is_hf_dir(path: pathlib.Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def export_checkpoint(cfg, checkpoint: pathlib.Path, work_dir: pathlib.Path) -> pathlib.Path:
    """Load the checkpoint's actor into a Megatron model and write its HF safetensors; returns the dir."""
    from sao_megatron.training.run.components import build_components, initial_weights, write_hf_export

    if not (checkpoint / "actor").is_dir():
        raise ValueError(f"--checkpoint {checkpoint} has no actor/ (and is not an HF dir with config.json and "
                         "*.safetensors); pass RUN_DIR/checkpoints/step_N or RUN_DIR/weights/vNNNNNN")
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, sft_steps=0),
                              actor=dataclasses.replace(cfg.actor, load=str(checkpoint / "actor")))
    out = work_dir / "hf_weights"
    c = build_components(cfg, with_critic=False)  # only the policy is exported
    initial_weights(c, cfg)
    write_hf_export(c, cfg.model, out, work_dir / "hf_template")
    return out


def evaluate_hf_dir(cfg, model_dir: pathlib.Path, *, num_prompts: int, temperature: float,
                    log_dir: pathlib.Path) -> dict[str, float]:
    """Serve ``model_dir`` on one embedded engine and evaluate the held-out problems."""
    from sao_megatron.envs import build_reward_schedule, build_task
    from sao_megatron.envs.rewards import RewardPool
    from sao_megatron.rollout.client import RolloutClient
    from sao_megatron.rollout.launch import LocalEngines
    from sao_megatron.training.run.evaluation import EvalConfig, eval_sampling, evaluate_prompts

    task = build_task(cfg.data, model=cfg.model)
    prompts = task.heldout_prompts(num_prompts)
    sampling = eval_sampling(EvalConfig(num_prompts=num_prompts, temperature=temperature), cfg.rollout.max_new_tokens)
    target = build_reward_schedule(cfg.data).target_at(0)
    engines = LocalEngines(model_dir, 1, extra_args=["--skip-tokenizer-init"], log_dir=log_dir)

    async def run(urls: list[str]):
        client, pool = RolloutClient(urls), RewardPool(cfg.data.reward_workers, cfg.data.reward_timeout_s)
        try:
            return await evaluate_prompts(client, task, prompts, sampling, max_turns=cfg.data.max_turns,
                                          max_total_tokens=cfg.data.max_total_tokens, reward_pool=pool,
                                          target=target)
        finally:
            pool.close()
            await client.aclose()

    try:
        return asyncio.run(run(engines.start())).metrics()
    finally:
        engines.stop()


def _run(args: argparse.Namespace) -> int:
    from sao_megatron.config import load_config
    from sao_megatron.training.run.evaluation import check_eval_config

    cfg = load_config(args.config, args.overrides)
    num = args.samples if args.samples is not None else cfg.eval.num_prompts
    temperature = args.temperature if args.temperature is not None else cfg.eval.temperature
    check_eval_config(dataclasses.replace(cfg.eval, num_prompts=num, temperature=temperature))
    ckpt = pathlib.Path(args.checkpoint)
    if not ckpt.is_dir():
        raise ValueError(f"--checkpoint {ckpt} is not a directory")
    work = pathlib.Path(args.work_dir) if args.work_dir else ckpt.parent / f"eval_{ckpt.name}"
    model_dir = ckpt if is_hf_dir(ckpt) else export_checkpoint(cfg, ckpt, work)
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return 0
    m = evaluate_hf_dir(cfg, model_dir, num_prompts=num, temperature=temperature, log_dir=work / "logs")
    sys.stdout.write(format_metrics(m, temperature) + "\n")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(m, indent=2))
    return 0


def format_metrics(m: dict[str, float], temperature: float) -> str:
    return (f"held-out problems: {m['eval/num_prompts']:.0f} (temperature {temperature:g}, one sample each)\n"
            f"pass@1      {m['eval/pass_at_1']:.3f}  95% CI [{m['eval/ci_low']:.3f}, {m['eval/ci_high']:.3f}] (Wilson)\n"
            f"mean reward {m['eval/mean_reward']:.3f}  95% CI [{m['eval/reward_ci_low']:.3f}, "
            f"{m['eval/reward_ci_high']:.3f}] (Student t)")
