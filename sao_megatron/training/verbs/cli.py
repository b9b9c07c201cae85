"""`sao-megatron train` and `sao-megatron sft`.

Single process: `sao-megatron train --config X.yaml --run-dir DIR`. Several processes:
`torchrun --nproc_per_node=N -m sao_megatron.cli train ...` (or srun under Slurm).
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import tempfile

from sao_megatron.config.cli import add_config_args

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    for verb, help_text in (("train", "run RL training (SAO and baselines) with asynchronous rollouts"),
                            ("sft", "supervised warm-up on task demonstrations; writes an actor checkpoint")):
        p = sub.add_parser(verb, help=help_text)
        add_config_args(p)
        p.add_argument("--run-dir", required=True, help="directory for config, metrics, checkpoints, logs")
        if verb == "train":
            p.add_argument("--resume", default="auto",
                           help="auto: continue from RUN_DIR's latest checkpoint if any (default); never: "
                                "refuse a run dir with checkpoints; or a checkpoint directory")
        p.set_defaults(func=_run_train if verb == "train" else _run_sft)


def _check_run_dir(path: str) -> pathlib.Path:
    run_dir = pathlib.Path(path)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        # A probe of its own per process: every local rank of a node runs this check at once on the same
        # directory, and a shared probe name let one rank unlink another's file (ENOENT, CI run 2026-12-02).
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write_test."):
            pass
    except OSError as exc:
        raise ValueError(f"--run-dir {run_dir} is not writable ({exc}); choose another directory") from exc
    return run_dir


def _run_train(args: argparse.Namespace) -> int:
    from sao_megatron.config import load_config
    from sao_megatron.training.run.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    trainer = Trainer(cfg, _check_run_dir(args.run_dir), resume=args.resume)
    return trainer.run()


def _run_sft(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from sao_megatron.config import load_config, write_resolved
    from sao_megatron.parallel.bootstrap import destroy
    from sao_megatron.training.run.checkpoint import save_checkpoint
    from sao_megatron.training.run.components import build_components, initial_weights

    cfg = load_config(args.config, args.overrides)
    if cfg.run.sft_steps < 1:
        raise ValueError("sft needs run.sft_steps >= 1 (e.g. --set run.sft_steps=200)")
    run_dir = _check_run_dir(args.run_dir)
    c = build_components(cfg, with_critic=False)  # the warm-up trains the policy only
    try:
        if dist.get_rank() == 0:
            write_resolved(cfg, run_dir)
        # As train starts: from actor.load or model.hf_dir (else the random init), then run.sft_steps.
        initial_weights(c, cfg)
        out = run_dir / "sft_actor"
        save_checkpoint(out, c.actor.chunks)
        log.info("actor after supervised warm-up -> %s (use --set actor.load=%s)", out, out)
    finally:
        destroy()
    return 0
