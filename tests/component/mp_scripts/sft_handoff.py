"""The `sao-megatron sft` verb's starting weights (world size 1).

    python light_main.py sft_handoff RESULTS.json WORKDIR write|compare CONFIG [KEY=VALUE ...]

``write``: an actor of CONFIG (with the overrides) whose every weight is set to fresh values, exported
as an HF dir (WORKDIR/hf) and kept as WORKDIR/written.pt. ``compare``: loads WORKDIR/run/sft_actor (what
`sao-megatron sft` wrote) into a fresh model and records how far it is from the written weights and
from that model's random init. The assertions live in tests/component/test_optimizer_weights.py.
"""

from __future__ import annotations

import json
import sys

import torch


def params(chunks, vocab: int) -> dict[str, torch.Tensor]:
    """fp32 copies by name, without the vocabulary's padding rows (no HF checkpoint holds them)."""
    def rows(name: str) -> slice:
        return slice(vocab if "word_embeddings." in name or "output_layer." in name else None)

    return {n: p.detach().float()[rows(n)].clone() for n, p in chunks[0].named_parameters()}


def write(cfg, ctx, workdir: str) -> dict:
    from sao_megatron.models.builder import build_model_chunks
    from sao_megatron.models.families import get_family, write_hf_template
    from sao_megatron.weights.disk import write_hf_safetensors
    from sao_megatron.weights.export import ExportPlan, iter_hf_tensors

    chunks = build_model_chunks(cfg.model, ctx)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 + 0.01)
    template = write_hf_template(cfg.model, None, f"{workdir}/hf_template")
    plan = ExportPlan(chunks, get_family(cfg.model.family).weight_map(cfg.model))
    write_hf_safetensors(iter_hf_tensors(plan), f"{workdir}/hf", template_dir=template)
    written = params(chunks, cfg.model.vocab_size)
    torch.save(written, f"{workdir}/written.pt")
    return {"num_params": len(written)}


def compare(cfg, ctx, workdir: str) -> dict:
    from sao_megatron.models.builder import build_model_chunks
    from sao_megatron.training.run.checkpoint import load_checkpoint

    written = torch.load(f"{workdir}/written.pt")
    chunks = build_model_chunks(cfg.model, ctx)
    init = params(chunks, cfg.model.vocab_size)
    load_checkpoint(f"{workdir}/run/sft_actor", chunks)
    saved = params(chunks, cfg.model.vocab_size)
    return {"num_params": len(saved), "saved_vs_written": max(float((saved[n] - written[n]).abs().max()) for n in saved),
            "init_vs_written_min": min(float((init[n] - written[n]).abs().max()) for n in saved)}


def main(out_path: str, workdir: str, mode: str, config: str, *overrides: str) -> None:
    from sao_megatron.config import load_config
    from sao_megatron.parallel.bootstrap import destroy, init_distributed

    cfg = load_config(config, list(overrides))
    ctx = init_distributed(cfg.parallel, seed=cfg.run.seed + 1, device=cfg.resources.device)
    out = (write if mode == "write" else compare)(cfg, ctx, workdir)
    destroy()
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
