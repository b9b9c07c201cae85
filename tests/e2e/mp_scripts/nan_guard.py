"""A non-finite loss skips the update (weights unchanged) and N in a row stop the run with a clear error.

usage: nan_guard.py CONFIG OUT_JSON   (single process)
"""

import json
import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from update_parity import fixed_samples  # noqa: E402


def main() -> None:
    config, out = sys.argv[1:3]
    from sao_megatron.config import load_config
    from sao_megatron.training.step.optim import NonFiniteLossError
    from sao_megatron.training.run.trainer import Trainer

    cfg = load_config(config, ["run.sft_steps=0", "run.max_nan_steps=2"])
    trainer = Trainer(cfg, pathlib.Path(out).parent / "nan_run", resume="never")
    before = [p.detach().clone() for p in trainer.c.actor.chunks[0].parameters()]
    good = trainer.update(fixed_samples(cfg.model.vocab_size))
    bad_samples = fixed_samples(cfg.model.vocab_size)
    for s in bad_samples:
        s.reward = math.nan
    after_good = [p.detach().clone() for p in trainer.c.actor.chunks[0].parameters()]
    first = trainer.update(bad_samples)
    unchanged = all(torch.equal(a, p) for a, p in zip(after_good, trainer.c.actor.chunks[0].parameters()))
    try:
        trainer.update(bad_samples)
        stopped = ""
    except NonFiniteLossError as exc:
        stopped = str(exc)
    result = {"good_applied": good.applied, "changed_by_good": any(not torch.equal(b, a)
                                                                       for b, a in zip(before, after_good)),
              "bad_applied": first.applied, "unchanged_by_bad": unchanged, "stopped": stopped}
    pathlib.Path(out).write_text(json.dumps(result))
    trainer.close()


if __name__ == "__main__":
    main()
