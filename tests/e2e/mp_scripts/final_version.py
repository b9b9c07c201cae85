"""A whole ``Trainer.run`` into two embedded engines; the engines are asked which version they serve when it ends.

usage: final_version.py CONFIG OUT_JSON [--set k=v ...]
Run under torchrun. The engines stop with the trainer, so their ``/model_info`` is read in ``close``,
after ``run`` finished its last step and (overlapped) waited for the last push.
"""

import json
import pathlib
import sys

import httpx
import torch.distributed as dist


def main() -> None:
    config, out = sys.argv[1:3]
    overrides = [sys.argv[3:][i + 1] for i, a in enumerate(sys.argv[3:]) if a == "--set"]
    from sao_megatron.config import load_config
    from sao_megatron.training.run.trainer import Trainer

    class Probe(Trainer):
        engine_versions: list[str] = []

        def close(self, **kw):
            if self.rollout is not None and self.rollout.client is not None:
                self.engine_versions = [httpx.get(u + "/model_info", trust_env=False).json()["weight_version"]
                                        for u in self.rollout.client.engine_urls]
            super().close(**kw)

    cfg = load_config(config, overrides)
    trainer = Probe(cfg, pathlib.Path(out).parent / f"run_{pathlib.Path(out).stem}", resume="never")
    try:
        trainer.run()
        if dist.get_rank() == 0:
            pathlib.Path(out).write_text(json.dumps({"version": trainer.version, "step": trainer.step,
                                                     "engine_versions": trainer.engine_versions,
                                                     "run_dir": str(trainer.run_dir)}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
