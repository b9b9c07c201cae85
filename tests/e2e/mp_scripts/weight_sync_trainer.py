"""The trainer's distributed weight sync into two embedded engines; run under torchrun at several layouts.

usage: weight_sync_trainer.py CONFIG OUT_JSON [--set k=v ...]
One real update (fixed batch) changes the actor; every rank then sends what it owns over its own
update groups (rollout.weight_sync=distributed, verified by checksums); then each engine's
log-probs are compared with the actor's on the same tokens (the parity gate).
"""

import json
import pathlib
import sys

import httpx
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from update_parity import fixed_samples  # noqa: E402


def main() -> None:
    config, out = sys.argv[1:3]
    overrides = [sys.argv[3:][i + 1] for i, a in enumerate(sys.argv[3:]) if a == "--set"]
    from sao_megatron.config import load_config
    from sao_megatron.training.components import initial_weights
    from sao_megatron.training.parity import measure_parity
    from sao_megatron.training.trainer import Trainer

    cfg = load_config(config, ["run.sft_steps=0", "rollout.weight_sync=distributed", "rollout.num_engines=2",
                               "scheduler.batch_size=8", "scheduler.concurrency=8", "data.num_prompts=200",
                               *overrides])
    trainer = Trainer(cfg, pathlib.Path(out).parent / f"run_{pathlib.Path(out).stem}", resume="never")
    try:
        initial_weights(trainer.c, cfg)
        trainer._start_rollout(None)
        if trainer._update(fixed_samples(cfg.model.vocab_size)).pop("_applied"):
            trainer.version += 1
        first = trainer._sync_weights()
        second = trainer._sync_weights()  # same layout: not verified again
        urls = trainer.rollout.client.engine_urls if trainer.rank0 else [None, None]
        gates = [measure_parity(trainer.c, cfg.model, trainer.run_dir, num_prompts=4, max_new_tokens=4,
                                temperature=1.0, seed=cfg.run.seed, engine_urls=[u]) for u in urls]
        if dist.get_rank() == 0:
            versions = [httpx.get(u + "/model_info", trust_env=False).json()["weight_version"] for u in urls]
            pathlib.Path(out).write_text(json.dumps({
                "version": trainer.version, "engine_versions": versions, "first": first, "second": second,
                "parity_max_abs": [g["parity/max_abs"] for g in gates],
                "parity_tokens": [g["parity/num_tokens"] for g in gates]}))
    finally:
        trainer.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
