"""The trainer's weight publishing into two embedded engines; run under torchrun at several layouts.

usage: weight_sync_trainer.py CONFIG OUT_JSON [--external] [--set k=v ...]
One real update (fixed batch) changes the actor; the publisher then pushes twice (versions 1 and 2;
rollout.weight_sync.transport=distributed by default: every rank sends what it owns over its own update groups,
verified by checksums); the client's health probe must keep every engine (they serve the published
version); then each engine's log-probs are compared with the actor's on the same tokens (the parity
gate). ``--external``: the engines are started here, from the initial weights, and the trainer reaches
them as ``rollout.engine=sglang`` servers (``rollout.engine_urls``), as a real SGLang deployment.
"""

import json
import pathlib
import sys

import httpx
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from update_parity import fixed_samples  # noqa: E402


def start_external(trainer, cfg, run_dir: pathlib.Path):
    """(single rank) Two embedded engines serving the initial weights; cfg.rollout now reaches them."""
    from sao_megatron.models.families import write_hf_template
    from sao_megatron.rollout.launch import LocalEngines
    from sao_megatron.weights.disk import write_hf_safetensors
    from sao_megatron.weights.export import export_weights

    template = write_hf_template(cfg.model, getattr(trainer.c.task, "tokenizer", None), run_dir / "ext_template")
    start = write_hf_safetensors(export_weights(trainer.c.exporter), run_dir / "ext_start", template_dir=template)
    engines = LocalEngines(start, 2, extra_args=["--weight-version", "0", "--skip-tokenizer-init"],
                           log_dir=run_dir / "ext_logs")
    engines.start()
    cfg.rollout.engine, cfg.rollout.engine_urls = "sglang", list(engines.urls)
    return engines


def main() -> None:
    config, out = sys.argv[1:3]
    external = "--external" in sys.argv[3:]
    overrides = [sys.argv[3:][i + 1] for i, a in enumerate(sys.argv[3:]) if a == "--set"]
    from sao_megatron.config import load_config
    from sao_megatron.training.run.components import initial_weights
    from sao_megatron.training.verbs.parity import measure_parity
    from sao_megatron.training.run.trainer import Trainer

    cfg = load_config(config, ["run.sft_steps=0", "rollout.weight_sync.transport=distributed", "rollout.num_engines=2",
                               "scheduler.batch_size=8", "scheduler.concurrency=8", "data.num_prompts=200",
                               *overrides])
    run_dir = pathlib.Path(out).parent / f"run_{pathlib.Path(out).stem}"
    trainer = Trainer(cfg, run_dir, resume="never")
    engines = None
    try:
        initial_weights(trainer.c, cfg)
        engines = start_external(trainer, cfg, run_dir) if external else None
        trainer._start_rollout(None)
        assert trainer.update(fixed_samples(cfg.model.vocab_size)).applied
        # With rollout.weight_sync.overlap a push's metrics come from the wait that joins it.
        first = trainer.publisher.publish() | trainer.publisher.wait()  # version 1
        second = trainer.publisher.publish() | trainer.publisher.wait()  # version 2, same layout: not verified again
        client = trainer.rollout.client if trainer.rank0 else None
        if client is not None:  # an episode retry probes health: the engines serve the pushed version
            trainer.rollout.bridge.run(client.health())
        urls = client.engine_urls if client is not None else [None, None]
        gates = [measure_parity(trainer.c, cfg.model, trainer.run_dir, num_prompts=4, max_new_tokens=4,
                                temperature=1.0, seed=cfg.run.seed, engine_urls=[u]) for u in urls]
        if dist.get_rank() == 0:
            versions = [httpx.get(u + "/model_info", trust_env=False).json()["weight_version"] for u in urls]
            pathlib.Path(out).write_text(json.dumps({
                "version": trainer.version, "engine_versions": versions, "first": first, "second": second,
                "client_version": client.weight_version, "healthy_after": len(client.healthy_urls()),
                "parity_max_abs": [g["parity/max_abs"] for g in gates],
                "parity_tokens": [g["parity/num_tokens"] for g in gates]}))
    finally:
        trainer.close()
        if engines is not None:
            engines.stop()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
