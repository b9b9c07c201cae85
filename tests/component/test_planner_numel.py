"""The planner's parameter counts equal the numel of the real Megatron models built on CPU.

Single process: whole-model counts, per critic parameter group, for actor and critic of several
small configs (Qwen3- and GLM-flavoured, tied and untied, dense layers, shared experts, LayerNorm).
Four ranks (torchrun, slow): each rank's local numel per group equals ``stage_params`` for its
pipeline stage under TP/SP, EP, expert-TP, PP and interleaved PP. This file is also the torchrun
worker (``__main__``): it writes one JSON line per rank and layout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

from sao_megatron.config import ModelConfig, ParallelConfig, load_config
from sao_megatron.launch.planner import GROUPS, Layout, count_params, padded_vocab_size, stage_params

ROOT = pathlib.Path(__file__).resolve().parents[2]

MODELS = {
    "tiny_moe": load_config(ROOT / "configs/models/tiny_moe.yaml").model,
    "glm_flavour": ModelConfig(
        family="glm4_moe", num_layers=4, hidden_size=48, ffn_hidden_size=80, num_attention_heads=6,
        num_query_groups=2, kv_channels=16, num_moe_experts=8, moe_ffn_hidden_size=24, moe_router_topk=2,
        moe_shared_expert_intermediate_size=40, moe_layer_freq=[0, 1, 1, 1], moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, add_qkv_bias=True,
        rotary_percent=0.5, vocab_size=300, max_position_embeddings=64),
    "tied_layernorm_every_2nd": ModelConfig(
        num_layers=4, hidden_size=32, ffn_hidden_size=56, num_attention_heads=4, num_query_groups=4,
        kv_channels=None, num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=1,
        moe_router_pre_softmax=True, moe_layer_freq=2, qk_layernorm=False, normalization="LayerNorm",
        untie_embeddings_and_output_weights=False,
        vocab_size=129, max_position_embeddings=64),
    "medium_qwen_widths": ModelConfig(
        num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8, num_query_groups=2,
        kv_channels=64, num_moe_experts=16, moe_ffn_hidden_size=96, moe_router_topk=4, vocab_size=1000,
        max_position_embeddings=128),
}

MP_LAYOUTS = {
    "tp2_ep2_sp": ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                 sequence_parallel=True),
    "pp2_ep2": ParallelConfig(pipeline_model_parallel_size=2, expert_model_parallel_size=2),
    "ep4_etp1_tp2_sp": ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=4,
                                      expert_tensor_parallel_size=1, sequence_parallel=True),
    "pp2_vpp2_tp2_sp": ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                                      tensor_model_parallel_size=2, sequence_parallel=True),
}


def local_group_numel(chunks, *, critic: bool) -> dict[str, int]:
    """This rank's parameters per planner group, classified by the critic's own name rules."""
    from sao_megatron.models.critic import param_group

    out = dict.fromkeys(GROUPS, 0)
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            out[param_group(name, is_value_head=critic)] += p.numel()
    return out


def build(model: ModelConfig, ctx, *, critic: bool):
    from sao_megatron.models.builder import build_model_chunks

    return build_model_chunks(model, ctx, value_head=critic)


@pytest.fixture(scope="module")
def single_rank_ctx(megatron_ctx):
    """Megatron in this process for this module only (see conftest.megatron_ctx)."""
    return megatron_ctx


@pytest.mark.component
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("critic", [False, True], ids=["actor", "critic"])
def test_count_params_equals_megatron_numel(single_rank_ctx, name, critic):
    model = MODELS[name]
    chunks = build(model, single_rank_ctx, critic=critic)
    real = local_group_numel(chunks, critic=critic)
    planned = count_params(model, critic=critic)
    assert planned.groups == real
    assert planned.total == sum(p.numel() for c in chunks for p in c.parameters())


@pytest.mark.component
def test_padding_agrees_with_the_builder():
    from sao_megatron.models.builder import VOCAB_DIVISIBLE_BY
    from sao_megatron.models.builder import padded_vocab_size as builder_padded

    for vocab in (1, 127, 128, 129, 151552, 151936, 154880):
        for tp in (1, 2, 4, 8):
            assert padded_vocab_size(vocab, tp) == builder_padded(vocab, tp) == padded_vocab_size(
                vocab, tp, VOCAB_DIVISIBLE_BY)


# ---------------------------------------------------------------- four ranks


def _worker(out_path: str) -> None:
    """torchrun entry: for every layout and model, this rank's numel per group vs ``stage_params``."""
    from sao_megatron.parallel.bootstrap import destroy, init_distributed

    rows = []
    for lname, parallel in MP_LAYOUTS.items():
        ctx = init_distributed(parallel, seed=1)
        lay = Layout(nodes=1, gpus_per_node=ctx.world_size, tp=ctx.tp_size, pp=ctx.pp_size, ep=ctx.ep_size,
                     etp=ctx.etp_size, vpp=ctx.vpp_size)
        for mname in ("glm_flavour", "tiny_moe"):
            model = MODELS[mname]
            if mname == "tiny_moe":  # 4 layers for PP2 x VPP2, 8 experts for EP4
                model = dataclasses.replace(model, num_layers=4, num_moe_experts=8)
            for critic in (False, True):
                real = local_group_numel(build(model, ctx, critic=critic), critic=critic)
                planned = stage_params(model, lay, ctx.pp_rank, critic=critic)
                rows.append({"layout": lname, "model": mname, "critic": critic, "rank": ctx.rank,
                             "pp_rank": ctx.pp_rank, "real": real, "planned": planned})
    with open(f"{out_path}.{os.environ['RANK']}", "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows))
    destroy()


@pytest.mark.component
@pytest.mark.slow
def test_stage_params_equal_local_numel_on_four_ranks(tmp_path):
    out = tmp_path / "numel.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", __file__, str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for rank in range(4)
            for line in (tmp_path / f"numel.jsonl.{rank}").read_text().splitlines()]
    assert len(rows) == 4 * len(MP_LAYOUTS) * 2 * 2
    bad = [r for r in rows if r["real"] != r["planned"]]
    assert not bad, json.dumps(bad[:3], indent=1)


if __name__ == "__main__":
    _worker(sys.argv[1])
