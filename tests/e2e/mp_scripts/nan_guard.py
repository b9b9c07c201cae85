"""A non-finite loss skips the update (weights unchanged) and N in a row stop the run with a clear error;
the step's ``after_actor`` hook (where an overlapped weight push starts) runs once the actor's update is
applied and before the critic steps, and not at all when the update is skipped.

usage: nan_guard.py CONFIG OUT_JSON   (single process)
"""

import json
import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from update_parity import fixed_samples  # noqa: E402


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for c in model.chunks for p in c.parameters()]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def main() -> None:
    config, out = sys.argv[1:3]
    from sao_megatron.config import load_config
    from sao_megatron.training.step.optim import NonFiniteLossError
    from sao_megatron.training.run.trainer import Trainer

    cfg = load_config(config, ["run.sft_steps=0", "run.max_nan_steps=2"])
    trainer = Trainer(cfg, pathlib.Path(out).parent / "nan_run", resume="never")
    before = [p.detach().clone() for p in trainer.c.actor.chunks[0].parameters()]
    critic_before, at_hook = params(trainer.c.critic), []
    good = trainer.update(fixed_samples(cfg.model.vocab_size),
                          after_actor=lambda: at_hook.append((params(trainer.c.actor), params(trainer.c.critic))))
    hook = {"hook_calls_good": len(at_hook),
            "actor_final_at_hook": same(at_hook[0][0], params(trainer.c.actor)) if at_hook else None,
            "critic_untouched_at_hook": same(at_hook[0][1], critic_before) if at_hook else None,
            "critic_changed_after": not same(params(trainer.c.critic), critic_before)}
    bad_samples = fixed_samples(cfg.model.vocab_size)
    for s in bad_samples:
        s.reward = math.nan
    after_good = [p.detach().clone() for p in trainer.c.actor.chunks[0].parameters()]
    first = trainer.update(bad_samples, after_actor=lambda: at_hook.append(None))
    unchanged = all(torch.equal(a, p) for a, p in zip(after_good, trainer.c.actor.chunks[0].parameters()))
    try:
        trainer.update(bad_samples)
        stopped = ""
    except NonFiniteLossError as exc:
        stopped = str(exc)
    result = {"good_applied": good.applied, "changed_by_good": any(not torch.equal(b, a)
                                                                       for b, a in zip(before, after_good)),
              "bad_applied": first.applied, "unchanged_by_bad": unchanged, "stopped": stopped,
              **hook, "hook_calls_bad": len(at_hook) - hook["hook_calls_good"]}
    pathlib.Path(out).write_text(json.dumps(result))
    trainer.close()


if __name__ == "__main__":
    main()
