"""Single-process Megatron checks (world size 1), run in a subprocess so the CPU shims never touch pytest.

    python megatron_single.py RESULTS.json WORKDIR

Each check records plain values into RESULTS.json; tests/component/test_megatron_single.py
asserts on them against slow, obviously-correct references computed here.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.nn.functional as F

from sao_megatron.config.schema import ModelConfig, OptimizerConfig, ParallelConfig
from sao_megatron.parallel import cpu_support
from sao_megatron.models.actor import token_logprobs
from sao_megatron.models.builder import build_model_chunks, padded_vocab_size
from sao_megatron.models.critic import PARAM_GROUPS, freeze_for_critic, param_group, token_values
from sao_megatron.training.run.checkpoint import load_checkpoint, save_checkpoint
from sao_megatron.parallel.bootstrap import destroy, init_distributed
from sao_megatron.training.step.forward import compute_logprobs, compute_values
from sao_megatron.training.run.models import TrainedModel
from sao_megatron.training.step.offload import grad_buffer_bytes, park, resident
from sao_megatron.training.step.optim import setup_optimizer, optimizer_step

GLM = ModelConfig(
    family="glm4_moe", num_layers=3, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
    num_query_groups=2, kv_channels=8, num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
    moe_shared_expert_intermediate_size=24, moe_layer_freq=[0, 1, 1], moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, add_qkv_bias=True,
    rotary_percent=0.5, rotary_base=5000, vocab_size=100, max_position_embeddings=64)


def architecture(model) -> dict:
    """What was actually built, read back from the modules."""
    layers = model.decoder.layers
    moe = layers[1].mlp
    qkv = layers[0].self_attention.linear_qkv
    return {
        "layer_mlp_types": [type(layer.mlp).__name__ for layer in layers],
        "router_score_function": moe.router.score_function,
        "router_topk_scaling_factor": moe.router.config.moe_router_topk_scaling_factor,
        "has_expert_bias": getattr(moe.router, "expert_bias", None) is not None,
        "has_shared_experts": getattr(moe, "shared_experts", None) is not None,
        "qkv_bias_shape": list(qkv.bias.shape) if qkv.bias is not None else None,
        "qkv_weight_shape": list(qkv.weight.shape),
        "q_layernorm": type(layers[0].self_attention.q_layernorm).__name__,
        "input_norm": type(layers[0].input_layernorm).__name__,
        "rotary_dim": int(model.rotary_pos_emb.inv_freq.numel() * 2),
        "rotary_inv_freq0": float(model.rotary_pos_emb.inv_freq[1]),
        "embedding_rows": int(model.embedding.word_embeddings.weight.shape[0]),
        "padded_vocab": padded_vocab_size(GLM.vocab_size, 1),
        "num_experts": len(moe.experts.local_experts),
        "dropout": [model.config.hidden_dropout, model.config.attention_dropout],
    }


def reference_logprobs(logits_bsv: torch.Tensor, tokens: torch.Tensor, vocab: int):
    """Loop over positions with a full log_softmax on the unpadded vocabulary."""
    b, s, _ = logits_bsv.shape
    lp, ent = torch.zeros(b, s), torch.zeros(b, s)
    for t in range(1, s):
        dist = F.log_softmax(logits_bsv[:, t - 1, :vocab].double(), dim=-1)
        lp[:, t] = dist.gather(-1, tokens[:, t:t + 1]).squeeze(-1).float()
        ent[:, t] = -(dist.exp() * dist).sum(-1).float()
    return lp, ent


def check_logprobs(actor, ctx, mbs, out: dict) -> None:
    mb = mbs[0]
    tokens = mb["tokens"]
    mask = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        logits = actor[0](tokens, torch.arange(tokens.shape[1]).expand_as(tokens), mask)
        # Make the padding rows dangerous: a log-softmax that forgot them would move a lot.
        logits[..., GLM.vocab_size:] = 30.0
    lp, ent = token_logprobs(logits, tokens, tp_group=ctx.tp_group, vocab_size=GLM.vocab_size)
    ref_lp, ref_ent = reference_logprobs(logits, tokens, GLM.vocab_size)
    out["logits_shape"] = list(logits.shape)
    out["logprob_vs_reference"] = float((lp - ref_lp).abs().max())
    out["entropy_vs_reference"] = float((ent - ref_ent).abs().max())
    out["logprob_col0"] = float(lp[:, 0].abs().max())
    scheduled = compute_logprobs(actor, mbs, ctx=ctx, vocab_size=GLM.vocab_size)
    lp_t, _ = token_logprobs(logits[..., :GLM.vocab_size], tokens, tp_group=None, vocab_size=GLM.vocab_size)
    out["compute_logprobs_vs_direct"] = float((scheduled[0] - lp_t).abs().max())
    out["compute_logprobs_shapes"] = [list(x.shape) for x in scheduled]


def check_critic(actor, ctx, mbs, workdir: str, out: dict) -> None:
    critic = build_model_chunks(GLM, ctx, value_head=True)
    # Initialise from the actor's checkpoint, leaving the value head out of the load.
    load_checkpoint(f"{workdir}/actor", critic, exclude=("output_layer.",))
    same = [torch.equal(a, c) for (n, a), (_, c) in zip(actor[0].named_parameters(), critic[0].named_parameters())
            if not n.startswith("output_layer.")]
    out["critic_trunk_equals_actor"] = all(same) and len(same) > 10
    out["value_head_zero"] = all(float(p.abs().max()) == 0 for p in critic[0].output_layer.parameters())
    names = [n for n, _ in critic[0].named_parameters()]
    out["param_groups"] = {n: param_group(n, is_value_head=True) for n in names}
    counts = freeze_for_critic(critic, ["routed_experts", "shared_experts", "value_head"])
    out["freeze_counts"] = counts
    out["numel_total"] = sum(p.numel() for p in critic[0].parameters())
    out["requires_grad"] = {n: p.requires_grad for n, p in critic[0].named_parameters()}
    ddp, opt, sched = setup_optimizer(critic, OptimizerConfig(lr=1e-2), ctx, total_steps=4)
    out["ddp_grad_params"] = sorted(n for n, p in critic[0].named_parameters() if hasattr(p, "main_grad"))
    num_tokens = sum(float(mb["tokens"][:, 1:].numel()) for mb in mbs)

    def loss_fn(values, mb):
        v = token_values(values)
        loss = 0.5 * ((v - mb["returns"])[:, 1:] ** 2).sum() / num_tokens
        return loss, {"loss": loss.detach(), "raw": values.detach()}

    res = optimizer_step(ddp, opt, sched, mbs, loss_fn, ctx=ctx)
    out["value_raw_shape"] = list(res.outputs[0]["raw"].shape)
    vals = compute_values(ddp, mbs, ctx=ctx)
    with torch.no_grad():  # the head's raw output after the step, to check the alignment
        tokens = mbs[0]["tokens"]
        mask = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool), 1)[None, None]
        raw = ddp[0](tokens, torch.arange(tokens.shape[1]).expand_as(tokens), mask)
    out["values_shape"] = list(vals[0].shape)
    out["values_alignment_err"] = float((vals[0][:, 1:] - raw[:, :-1, 0]).abs().max())
    out["values_col0"] = float(vals[0][:, 0].abs().max())


def check_direct_backward(actor, mbs, out: dict) -> None:
    """A plain loss.backward() (outside Megatron's schedules) under the CPU device mode."""
    tokens = mbs[0]["tokens"]
    mask = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool), 1)[None, None]
    logits = actor[0](tokens, torch.arange(tokens.shape[1]).expand_as(tokens), mask)
    logits.float().logsumexp(-1).mean().backward()
    out["direct_backward_grad_norm"] = float(sum(p.grad.norm() ** 2 for p in actor[0].parameters()
                                                 if p.grad is not None) ** 0.5)


def check_recompute(ctx, mbs, out: dict) -> None:
    """Full and selective recompute give the same gradients as none, and really re-run the layers.

    Counted by forward hooks: with ``full`` every transformer layer runs again in backward; with
    ``selective`` only core attention does.
    """
    tokens = mbs[0]["tokens"]
    mask = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool), 1)[None, None]
    state, grads = None, {}
    for granularity in ("none", "full", "selective"):
        model = build_model_chunks(GLM, ctx, recompute=granularity)[0]
        if state is None:
            state = {k: v.clone() for k, v in model.state_dict().items() if v is not None and torch.is_tensor(v)}
        model.load_state_dict(state, strict=False)
        model.train()
        calls = {"layer": 0, "core_attn": 0, "input_norm": 0, "experts": 0}
        layer = model.decoder.layers[1]
        for name, module in (("layer", layer), ("core_attn", layer.self_attention.core_attention),
                             ("input_norm", layer.input_layernorm), ("experts", layer.mlp.experts)):
            module.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
        logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), mask)
        logits.float().logsumexp(-1).mean().backward()
        grads[granularity] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out[f"recompute_{granularity}_calls"] = calls
        out[f"recompute_{granularity}_config"] = [model.config.recompute_granularity, model.config.recompute_method,
                                                   model.config.recompute_num_layers, model.config.recompute_modules]
    for granularity in ("full", "selective"):
        same_keys = grads[granularity].keys() == grads["none"].keys()
        diff = max(float((grads[granularity][n] - g).abs().max()) for n, g in grads["none"].items())
        out[f"recompute_{granularity}_grad_diff"] = diff if same_keys else float("inf")
    out["recompute_num_grads"] = len(grads["none"])


def check_offload(ctx, mbs, out: dict) -> None:
    """resources.offload_idle_optimizer: bf16 actor, distributed optimizer. Parked, the grad buffers
    hold no memory; inside ``resident`` they are back; losses and weights equal a run without offload."""
    model_cfg = dataclasses.replace(GLM, params_dtype="bf16")
    num_tokens = sum(float(mb["tokens"].numel()) for mb in mbs)

    def loss_fn(logits, mb):
        loss = logits.float().logsumexp(-1).sum() / num_tokens
        return loss, {"loss": loss.detach()}

    init, runs = None, {}
    for offload in (False, True):
        chunks = build_model_chunks(model_cfg, ctx)
        if init is None:
            init = {k: v.clone() for k, v in chunks[0].state_dict().items() if torch.is_tensor(v)}
        chunks[0].load_state_dict(init, strict=False)
        ddp, opt, sched = setup_optimizer(chunks, OptimizerConfig(lr=1e-2), ctx, total_steps=4)
        model = TrainedModel(chunks=chunks, ddp=ddp, optimizer=opt, scheduler=sched, param_counts={})
        park(model, offload=offload)
        run = {"losses": [], "bytes_parked": [], "bytes_resident": []}
        for _ in range(3):
            run["bytes_parked"].append(grad_buffer_bytes(model))
            with resident(model, offload=offload):
                run["bytes_resident"].append(grad_buffer_bytes(model))
                res = optimizer_step(ddp, opt, sched, mbs, loss_fn, ctx=ctx)
            run["losses"].append(float(sum(m["loss"] for m in res.outputs)))
        run["params"] = {n: p.detach().float().clone() for n, p in chunks[0].named_parameters()}
        runs[offload] = run
    out["offload_losses"] = [runs[False]["losses"], runs[True]["losses"]]
    out["offload_param_diff"] = max(float((p - runs[True]["params"][n]).abs().max())
                                    for n, p in runs[False]["params"].items())
    out["offload_params_changed"] = max(float((p - init[n].float()).abs().max()) for n, p in runs[True]["params"].items())
    out["offload_bytes"] = {str(k): [r["bytes_parked"], r["bytes_resident"]] for k, r in runs.items()}


def main(out_path: str, workdir: str) -> None:
    out: dict = {}
    cpu_support.apply_cpu_shims()
    depth = torch._C._len_torch_function_stack()
    cpu_support.apply_cpu_shims()  # idempotent: no second mode, no double wrapping
    out["mode_depth_after_two_applies"] = [depth, torch._C._len_torch_function_stack()]
    out["tensor_type_reported"] = torch.zeros(1).type()
    out["cuda_alloc_maps_to"] = str(torch.empty(1, device="cuda").device)
    ctx = init_distributed(ParallelConfig(), seed=3)
    actor = build_model_chunks(GLM, ctx)
    out["architecture"] = architecture(actor[0])
    g = torch.Generator().manual_seed(0)
    mbs = [{"tokens": torch.randint(0, GLM.vocab_size, (2, s), generator=g),
            "returns": torch.randn(2, s, generator=g)} for s in (12, 9)]
    save_checkpoint(f"{workdir}/actor", actor)
    check_logprobs(actor, ctx, mbs, out)
    check_critic(actor, ctx, mbs, workdir, out)
    check_direct_backward(actor, mbs, out)
    check_recompute(ctx, mbs, out)
    check_offload(ctx, mbs, out)
    out["known_groups"] = list(PARAM_GROUPS)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)
    destroy()


if __name__ == "__main__":  # dist checkpoint saving starts a multiprocessing manager
    main(sys.argv[1], sys.argv[2])
