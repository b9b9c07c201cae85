"""Device placement without a GPU: every model family built as on a CUDA node, CUDA mapped to ``meta``.

    python device_placement.py RESULTS.json WORKDIR

The context says the run trains on ``cuda:0`` (so ``use_cpu_initialization`` is off, as on a GPU
node) and ``CudaToMetaMode`` maps every CUDA placement to the ``meta`` device: a tensor that
reached the device is on ``meta``, one that Megatron (or we) left on the CPU is still there.
For each family and role RESULTS.json records the build error (if any), every parameter and
buffer not on ``meta``, the parameters' Megatron tags (against a CPU build), where a forward of
the MoE model stops, the batch path through Megatron's forward schedule on a dense variant, and
(actors) where the weight-sync export stream's tensors, the DDP buffers and the optimizer's master
parameters are.
tests/component/test_device_placement.py asserts on it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import traceback

import torch

from sao_megatron.config import ModelConfig, OptimizerConfig, ParallelConfig, load_config
from sao_megatron.models.builder import build_model_chunks
from sao_megatron.models.families import get_family
from sao_megatron.parallel.bootstrap import init_distributed
from sao_megatron.parallel.cpu_support import CudaToMetaMode
from sao_megatron.scheduler.sample import Sample
from sao_megatron.weights.export import ExportPlan, iter_hf_tensors
from sao_megatron.training.step.batch import prepare_batch
from sao_megatron.training.step.forward import compute_logprobs, compute_values
from sao_megatron.training.step.optim import setup_optimizer

ROOT = pathlib.Path(__file__).resolve().parents[3]
META = torch.device("meta")
BF16 = {"params_dtype": "bf16"}  # as GPU runs train
FAMILIES = {
    "tiny_moe": dataclasses.replace(load_config(ROOT / "configs/models/tiny_moe.yaml").model, **BF16),
    # GLM-4.5-like: a dense first layer, shared experts, sigmoid router with expert bias, QKV bias.
    "glm45_like": ModelConfig(
        family="glm4_moe", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
        num_query_groups=2, kv_channels=8, num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
        moe_shared_expert_intermediate_size=24, moe_layer_freq=[0, 1], moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, add_qkv_bias=True,
        rotary_percent=0.5, vocab_size=100, max_position_embeddings=64, **BF16),
    "tiny_glm5": dataclasses.replace(load_config(ROOT / "configs/models/tiny_glm5.yaml").model, **BF16),  # MLA+DSA
}


def off_meta(chunks) -> list[str]:
    """Every parameter and buffer of the chunks that is not on ``meta``, as ``name@device``."""
    named = [(n, t) for c in chunks for n, t in [*c.named_parameters(), *c.named_buffers()]]
    return [f"{n}@{t.device}" for n, t in named if t.device != META]


def param_tags(chunks) -> dict[str, list[str]]:
    """Python attributes of every parameter (Megatron's tensor-parallel/sequence-parallel/expert tags)."""
    return {n: sorted(vars(p)) for c in chunks for n, p in c.named_parameters()}


def moe_forward(chunk, vocab_size: int) -> dict:
    """A forward of the whole model on a [2, 16] batch sent to ``cuda`` (so: ``meta``): its output
    device, or where it stopped (the last megatron frame) and why."""
    tokens = torch.randint(0, vocab_size, (2, 16)).to("cuda")
    positions = torch.arange(16).expand(2, -1).to("cuda")
    mask = torch.ones(16, 16, dtype=torch.bool).triu(1)[None, None].to("cuda")
    try:
        with torch.no_grad():
            out = chunk(tokens, positions, mask)
    except Exception as err:  # noqa: BLE001 - where the emulation stops is the result
        frames = [f for f in traceback.extract_tb(err.__traceback__) if "/megatron/" in f.filename]
        where = f"{pathlib.Path(frames[-1].filename).stem}.{frames[-1].name}" if frames else "?"
        return {"stopped_in": where, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
    return {"device": str(out.device)}


def dense_batch_path(model: ModelConfig, ctx, *, critic: bool) -> dict:
    """The same family with every layer dense (the MoE dispatch reads token counts, which meta tensors
    lack): a batch from ``prepare_batch(device=ctx.device)`` through Megatron's forward schedule."""
    dense = dataclasses.replace(model, moe_layer_freq=[0] * model.num_layers)
    chunks = build_model_chunks(dense, ctx, value_head=critic)
    samples = [Sample(prompt_ids=[1, 2], response_ids=list(range(3, 5 + i)), action_mask=[1] * (2 + i),
                      rollout_logprobs=[-1.0] * (2 + i), versions=[0] * (2 + i), index=i, group_id=i)
               for i in range(4)]
    batch = prepare_batch(samples, dp_rank=0, dp_size=1, pad_multiple=1, max_tokens=64, vocab_size=50,
                          device=ctx.device)
    if critic:
        out = compute_values(chunks, batch.microbatches, ctx=ctx)
    else:
        out = compute_logprobs(chunks, batch.microbatches, ctx=ctx, vocab_size=model.vocab_size)
    return {"batch_devices": sorted({str(t.device) for mb in batch.microbatches for t in mb.values()}),
            "output_dtypes": sorted({str(t.dtype) for t in out}),
            "output_devices": sorted({str(t.device) for t in out}),
            "output_shapes": [list(t.shape) for t in out]}


def exported(chunks, model: ModelConfig) -> dict:
    """The weight-sync export stream (HF names, full tensors) of a ``meta``-placed actor: where its
    tensors are (the exporter streams from the device; a host copy would need values meta lacks)."""
    plan = ExportPlan(chunks, get_family(model.family).weight_map(model))
    tensors = list(iter_hf_tensors(plan, receivers="rank0"))
    return {"num_tensors": len(tensors), "devices": sorted({str(t.device) for _, t in tensors})}


def optimizer_placement(chunks, ctx) -> dict:
    """Megatron's DDP buffers and the distributed optimizer's master parameters of a ``meta``-placed
    actor. (A training step then stops at the gradient reduce-scatter: c10d has no meta kernels.)"""
    ddp, opt, _ = setup_optimizer(chunks, OptimizerConfig(lr=1e-3), ctx, total_steps=2)
    buffers = [t for c in ddp for b in [*c.buffers, *c.expert_parallel_buffers] for t in (b.param_data, b.grad_data)
               if t is not None]
    main = [p for group in opt.param_groups for p in group["params"]]
    return {"buffers": sorted({str(t.device) for t in buffers}), "main_params": sorted({str(p.device) for p in main}),
            "main_dtypes": sorted({str(p.dtype) for p in main}), "num_main_params": len(main)}


def recorded(fn, *args, **kwargs) -> dict:
    """fn's result, or the error that stopped it (one test fails, not the whole module)."""
    try:
        return fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - recorded for the test to show
        return {"error": f"{type(err).__name__}: {err}", "where": traceback.format_exc(limit=-3)}


def check(model: ModelConfig, ctx, cpu_ctx, *, critic: bool) -> dict:
    with CudaToMetaMode():
        try:
            chunks = build_model_chunks(model, ctx, value_head=critic)
        except RuntimeError as err:
            return {"error": str(err)}
        out = {"off_meta": off_meta(chunks), "use_cpu_initialization": chunks[0].config.use_cpu_initialization,
               "num_tensors": len([*chunks[0].parameters(), *chunks[0].buffers()]), "tags": param_tags(chunks),
               "forward": moe_forward(chunks[0], model.vocab_size),
               "dense": recorded(dense_batch_path, model, ctx, critic=critic)}
        if not critic:
            out["export"] = recorded(exported, chunks, model)
            out["optimizer"] = recorded(optimizer_placement, chunks, ctx)
    out["cpu_tags"] = param_tags(build_model_chunks(model, cpu_ctx, value_head=critic))
    return out


def main(out_path: str, workdir: str) -> None:
    from megatron.core.transformer.experimental_attention_variant import dsa

    kernel_rotate = dsa.rotate_activation  # megatron's own, before the CPU shims replace it
    ctx = init_distributed(ParallelConfig(), seed=1, device="cpu", environ={})
    # As on a CUDA node without fast_hadamard_transform: the CPU shims' fallback is not there, the
    # builder must put it in place for the DSA model (issue 37, defect 7).
    dsa.rotate_activation = kernel_rotate
    cuda_ctx = dataclasses.replace(ctx, device=torch.device("cuda", 0))
    results = {f"{name}/{'critic' if critic else 'actor'}": check(model, cuda_ctx, ctx, critic=critic)
               for name, model in FAMILIES.items() for critic in (False, True)}
    pathlib.Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
