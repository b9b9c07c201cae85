"""One trainer update (`Trainer.update`) on a fixed batch; run under torchrun at several layouts.

usage: update_parity.py CONFIG CKPT_DIR OUT_JSON [--save] [--set k=v ...]
With --save (TP1), the freshly initialised actor+critic are saved to CKPT_DIR first; every layout
then loads that checkpoint (resharding), so all layouts start from identical weights.
"""

import json
import pathlib
import random
import sys

import torch.distributed as dist


def fixed_samples(vocab: int, n: int = 12):
    from sao_megatron.scheduler.sample import Sample

    rng = random.Random(0)
    out = []
    for i in range(n):
        prompt = [1] + [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
        resp = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))]
        mask = [1] * len(resp)
        if len(resp) > 4:  # a multi-turn shape: an observation run in the middle
            mask[2:4] = [0, 0]
        logp = [-rng.uniform(2.0, 6.0) if m else 0.0 for m in mask]
        out.append(Sample(prompt_ids=prompt, response_ids=resp, action_mask=mask, rollout_logprobs=logp,
                          versions=[0 if m else -1 for m in mask], reward=rng.random(), index=i, group_id=i))
    return out


def main() -> None:
    config, ckpt, out = sys.argv[1:4]
    rest = sys.argv[4:]
    save = "--save" in rest
    overrides = [rest[i + 1] for i, a in enumerate(rest) if a == "--set"]
    from sao_megatron.config import load_config
    from sao_megatron.training.run.checkpoint import load_checkpoint, save_checkpoint
    from sao_megatron.training.run.trainer import Trainer

    cfg = load_config(config, ["run.sft_steps=0", *overrides])
    run_dir = pathlib.Path(out).parent / f"run_{pathlib.Path(out).stem}"
    trainer = Trainer(cfg, run_dir, resume="never")
    if save:
        save_checkpoint(pathlib.Path(ckpt) / "actor", trainer.c.actor.chunks)
        save_checkpoint(pathlib.Path(ckpt) / "critic", trainer.c.critic.chunks)
    load_checkpoint(pathlib.Path(ckpt) / "actor", trainer.c.actor.chunks)
    load_checkpoint(pathlib.Path(ckpt) / "critic", trainer.c.critic.chunks)
    metrics = trainer.update(fixed_samples(cfg.model.vocab_size)).metrics
    if dist.get_rank() == 0:
        keep = {k: v for k, v in metrics.items() if isinstance(v, float)}
        pathlib.Path(out).write_text(json.dumps(keep))
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
