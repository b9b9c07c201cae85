"""Starting weights and Adam state through Megatron's optimizers (issue 37, defects 5 and 6).

    python light_main.py optimizer_weights RESULTS.json WORKDIR

World size 1, for the plain and the distributed optimizer. Records into RESULTS.json:
- ``start/<opt>/<case>``: weights written after the optimizer exists (``initial_weights``: the actor from
  ``model.hf_dir`` and from ``actor.load``, the critic from the actor and from ``critic.init_from``), then
  one optimizer step at lr 1e-12, in bf16: how far the stepped weights are from the written ones, and how
  far the random init the optimizer was built with is from them;
- ``resume/<opt>/<dtype>``: a run stepped N times, saved with its optimizer, resumed into a fresh model
  and stepped M more, against the same run stepped N + M times without interruption: Adam's per-parameter
  step counts, the largest difference of exp_avg, exp_avg_sq, master weights and model weights.
The assertions live in tests/component/test_optimizer_weights.py.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

TINY = dict(family="qwen3_moe", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
            num_query_groups=2, kv_channels=8, num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
            vocab_size=100, max_position_embeddings=64)
TINY_LR = 1e-12
N_STEPS, M_STEPS = 2, 2


def microbatches(step: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [{"tokens": torch.randint(0, vocab, (2, 12), generator=g)}]


def lse_loss(out, mb):
    """Any smooth scalar of the output (logits or values) that gives every parameter a gradient."""
    loss = torch.logsumexp(out.float(), dim=-1).mean()
    return loss, {"loss": loss.detach()}


def params(chunks, *, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Parameters by name in fp32, without the vocabulary's padding rows (no HF checkpoint holds them)."""
    from sao_megatron.models.critic import is_critic

    def rows(name: str) -> slice:
        vocab_sized = "word_embeddings." in name or ("output_layer." in name and not is_critic(chunks[0]))
        return slice(TINY["vocab_size"] if vocab_sized else None)

    return {n: p.detach().float()[rows(n)].clone() for n, p in chunks[0].named_parameters()
            if not any(s in n for s in skip)}


def perturb(chunks, seed: int) -> dict[str, torch.Tensor]:
    """Overwrite every parameter with fresh values (nothing like any random init); returns them as written."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 + 0.01)
    return params(chunks)


def max_abs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in names)


def min_of_max_abs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names) -> float:
    """The smallest per-tensor max |a - b|: > 0 when every tensor tells a from b."""
    return min(float((a[n] - b[n]).abs().max()) for n in names)


# ------------------------------------------------------------------ defect 5: starting weights
def write_sources(cfg, ctx, workdir: str) -> dict:
    """An HF dir and model-only checkpoints of an actor and a critic whose weights the runs must start from."""
    from sao_megatron.models.builder import build_model_chunks
    from sao_megatron.models.families import get_family, write_hf_template
    from sao_megatron.weights.disk import write_hf_safetensors
    from sao_megatron.training.run.checkpoint import save_checkpoint
    from sao_megatron.weights.export import ExportPlan, iter_hf_tensors

    actor = build_model_chunks(cfg.model, ctx)
    src = {"actor": perturb(actor, seed=7)}
    plan = ExportPlan(actor, get_family(cfg.model.family).weight_map(cfg.model))
    template = write_hf_template(cfg.model, None, f"{workdir}/hf_template")
    write_hf_safetensors(iter_hf_tensors(plan), f"{workdir}/hf", template_dir=template)
    save_checkpoint(f"{workdir}/actor_ckpt", actor)
    critic = build_model_chunks(cfg.model, ctx, value_head=True)
    src["critic"] = perturb(critic, seed=8)
    save_checkpoint(f"{workdir}/critic_ckpt", critic)
    return src


def start_case(cfg, ctx, case: str, src: dict) -> dict:
    """``initial_weights`` for one case, then one step at ``TINY_LR``: distances to the written weights."""
    from sao_megatron.training.run.components import Components, initial_weights
    from sao_megatron.training.run.models import build_actor, build_critic
    from sao_megatron.training.step.optim import optimizer_step

    actor = build_actor(cfg.model, cfg.actor, ctx, total_steps=4)
    critic = build_critic(cfg.model, cfg.critic, ctx, total_steps=4) if case.startswith("critic") else None
    trained = critic or actor
    # The critic's value head is not copied from the actor: compare the trunk (the head starts at zero).
    skip = ("output_layer.",) if case == "critic_from_actor" else ()
    init = params(trained.chunks, skip=skip)
    c = Components(ctx=ctx, objective=None, mode="sync", task=None, actor=actor, critic=critic, baseline=None,
                   exporter=None)
    initial_weights(c, cfg)
    written = src["critic" if case == "critic_from_checkpoint" else "actor"]
    trainable = [n for n, p in trained.chunks[0].named_parameters() if p.requires_grad and n in init]
    result = optimizer_step(trained.ddp, trained.optimizer, trained.scheduler, microbatches(0, cfg.model.vocab_size),
                            lse_loss, ctx=ctx)
    after = params(trained.chunks, skip=skip)
    return {"applied": result.applied, "num_trainable": len(trainable),
            "after_vs_written": max_abs(after, written, init),
            "trainable_after_vs_written": max_abs(after, written, trainable),
            "init_vs_written_min": min_of_max_abs(init, written, trainable)}


def starting_weights(base, ctx, workdir: str) -> dict:
    from sao_megatron.config.schema import OptimizerConfig

    opt = OptimizerConfig(lr=TINY_LR)
    cfg = dataclasses.replace(base, actor=dataclasses.replace(base.actor, optimizer=opt),
                              critic=dataclasses.replace(base.critic, optimizer=opt))
    src = write_sources(cfg, ctx, workdir)
    cases = {
        "actor_from_hf_dir": dict(model=dataclasses.replace(cfg.model, hf_dir=f"{workdir}/hf")),
        "actor_from_load": dict(actor=dataclasses.replace(cfg.actor, load=f"{workdir}/actor_ckpt")),
        "critic_from_actor": dict(actor=dataclasses.replace(cfg.actor, load=f"{workdir}/actor_ckpt")),
        "critic_from_checkpoint": dict(critic=dataclasses.replace(cfg.critic, init_from=f"{workdir}/critic_ckpt")),
    }
    return {case: start_case(dataclasses.replace(cfg, **fields), ctx, case, src) for case, fields in cases.items()}


# ------------------------------------------------------------------ defect 6: Adam state after resume
def adam_state(optimizer) -> list[dict[str, torch.Tensor | float]]:
    """Per optimizer parameter (fp32 master weight, or the fp32 parameter itself): step and moments."""
    out = []
    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = sub.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                s = inner.state[p]
                out.append({"step": float(s["step"]), "exp_avg": s["exp_avg"].clone(),
                            "exp_avg_sq": s["exp_avg_sq"].clone(), "master": p.detach().float().clone()})
    return out


def train(model, steps: range, vocab: int, ctx) -> None:
    from sao_megatron.training.step.optim import optimizer_step

    for step in steps:
        assert optimizer_step(model.ddp, model.optimizer, model.scheduler, microbatches(step, vocab), lse_loss,
                              ctx=ctx).applied


def resume_case(cfg, ctx, workdir: str) -> dict:
    """N steps, save (model + optimizer + LR schedule), M more; against a fresh model loaded from the save."""
    from sao_megatron.training.run.checkpoint import load_checkpoint, save_checkpoint
    from sao_megatron.training.run.models import build_actor

    vocab = cfg.model.vocab_size
    whole = build_actor(cfg.model, cfg.actor, ctx, total_steps=N_STEPS + M_STEPS)
    train(whole, range(N_STEPS), vocab, ctx)
    save_checkpoint(workdir, whole.chunks, whole.optimizer)
    lr_state = whole.scheduler.state_dict()
    train(whole, range(N_STEPS, N_STEPS + M_STEPS), vocab, ctx)

    resumed = build_actor(cfg.model, cfg.actor, ctx, total_steps=N_STEPS + M_STEPS)
    load_checkpoint(workdir, resumed.chunks, resumed.optimizer)  # as run_state.restore does
    resumed.scheduler.load_state_dict(lr_state)
    train(resumed, range(N_STEPS, N_STEPS + M_STEPS), vocab, ctx)

    a, b = adam_state(whole.optimizer), adam_state(resumed.optimizer)
    assert len(a) == len(b) > 0
    diff = {k: max(float((x[k] - y[k]).abs().max()) for x, y in zip(a, b)) for k in ("exp_avg", "exp_avg_sq", "master")}
    wa, wb = params(whole.chunks), params(resumed.chunks)
    return {"num_params": len(a), "steps_whole": sorted({x["step"] for x in a}),
            "steps_resumed": sorted({y["step"] for y in b}), **diff, "weights": max_abs(wa, wb, wa)}


def main(out_path: str, workdir: str) -> None:
    from sao_megatron.config.schema import ActorConfig, ExperimentConfig, ModelConfig, OptimizerConfig
    from sao_megatron.parallel.bootstrap import destroy, init_distributed

    ctx = init_distributed(ExperimentConfig().parallel, seed=3)
    out: dict = {"start": {}, "resume": {}}
    for name, distributed in (("plain", False), ("distributed", True)):
        octx = dataclasses.replace(ctx, parallel=dataclasses.replace(ctx.parallel, use_distributed_optimizer=distributed))
        bf16 = ExperimentConfig(model=ModelConfig(**TINY, params_dtype="bf16"))
        out["start"][name] = starting_weights(bf16, octx, f"{workdir}/start_{name}")
        for dtype in ("fp32", "bf16"):
            cfg = ExperimentConfig(model=ModelConfig(**TINY, params_dtype=dtype),
                                   actor=ActorConfig(optimizer=OptimizerConfig(lr=1e-3)))
            out["resume"].setdefault(name, {})[dtype] = resume_case(cfg, octx, f"{workdir}/resume_{name}_{dtype}")
    destroy()
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
