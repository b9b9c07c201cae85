"""GRPO's clip against the old policy bites only with several optimizer steps per batch.

usage: ppo_epochs.py CONFIG OUT_JSON   (single process)
One Trainer update on a fixed grouped batch with actor.ppo_epochs x actor.num_minibatches = 1 x 1
(the ratio against the recomputed old policy is exactly 1: nothing can clip) and 2 x 2 (four steps;
after the first, the policy has moved and the clip fires).
"""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from update_parity import fixed_samples  # noqa: E402


def grouped(vocab: int):
    out = fixed_samples(vocab, n=16)
    for i, s in enumerate(out):
        s.group_id = i // 4  # groups of 4 with different rewards: non-zero GRPO advantages
        s.reward = float(i % 3 == 0)
    return out


def one_update(config: str, run_dir: pathlib.Path, epochs: int, minibatches: int) -> dict:
    from sao_megatron.config import load_config
    from sao_megatron.training.run.trainer import Trainer

    cfg = load_config(config, ["run.sft_steps=0", "algorithm.name=grpo", "algorithm.group_size=4",
                               "scheduler.batch_size=16", "actor.optimizer.lr=0.05",
                               f"actor.ppo_epochs={epochs}", f"actor.num_minibatches={minibatches}"])
    trainer = Trainer(cfg, run_dir, resume="never")
    result = trainer.update(grouped(cfg.model.vocab_size))
    metrics = result.metrics
    out = {"clip_frac": metrics.get("actor/clip_frac"), "applied": result.applied,
           "lr_steps": trainer.c.actor.scheduler.num_steps}
    trainer.close()
    return out


def main() -> None:
    config, out = sys.argv[1:3]
    base = pathlib.Path(out).parent
    result = {"single": one_update(config, base / "single", 1, 1), "epochs": one_update(config, base / "epochs", 2, 2)}
    pathlib.Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
