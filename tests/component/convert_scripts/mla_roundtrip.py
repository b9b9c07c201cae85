"""One process: DeepSeek-V3 / GLM-5 fixtures -> Megatron -> parity -> HF export, plus checks that have teeth.

Run by tests/component/test_convert_mla.py; writes a JSON report. Usage:
    python mla_roundtrip.py WORK_DIR RESULT_JSON [--quick]
Per shape: TP1 conversion, fp32 parity on sequences longer than the indexer's top-k, export.
Teeth: the sparse top-k changes transformers' own logits (so parity covers the sparse path);
dropping YaRN / group-limited routing / swapping the indexer's k_norm weight and bias each
break parity; the unshimmed ``rotate_activation`` fails on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import mla_fixtures  # noqa: E402

SEQ_LEN = 32  # > every fixture's index_topk


def sparse_effect(hf_dir: pathlib.Path) -> float:
    """Max logit change in transformers when the indexer's top-k covers every key (dense attention)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokens = torch.randint(0, 96, (2, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    sparse = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    config = AutoConfig.from_pretrained(str(hf_dir))
    config.index_topk = 4 * SEQ_LEN
    dense = AutoModelForCausalLM.from_pretrained(str(hf_dir), config=config, dtype=torch.float32,
                                                 attn_implementation="eager")
    return float((sparse.eval()(input_ids=tokens).logits - dense.eval()(input_ids=tokens).logits).abs().max())


def unshimmed_rotate_fails() -> str:
    """Megatron's own rotate_activation on a CPU fp32 tensor (captured before the shims patch it)."""
    import torch
    from megatron.core.transformer.experimental_attention_variant import dsa

    try:
        dsa.rotate_activation(torch.randn(2, 16))
    except (AssertionError, RuntimeError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def mutated_parity(hf_dir: pathlib.Path, ctx_holder: dict, *, cfg_changes: dict | None = None,
                   swap_k_norm: bool = False) -> float:
    """Parity of a TP1 model built with a changed config or mapping (no files written)."""
    from checkpoints_tools.hf_to_mcore import open_hf
    from checkpoints_tools.parity import check_parity
    from sao_megatron.models.builder import build_model_chunks
    from sao_megatron.models.families.sharded import load_hf_weights

    src = open_hf(hf_dir, dtype="fp32")
    cfg = dataclasses.replace(src.model_cfg, **(cfg_changes or {}))
    family = src.family
    if swap_k_norm:
        rules = tuple(dataclasses.replace(r, hf=(r.hf[0].replace("k_norm.weight", "k_norm.TMP")
                                                 .replace("k_norm.bias", "k_norm.weight")
                                                 .replace("k_norm.TMP", "k_norm.bias"),))
                      if "k_norm" in r.mcore else r for r in family.rules)
        family = family.with_rules(rules)
    chunks = build_model_chunks(cfg, ctx_holder["ctx"])
    load_hf_weights(chunks, family.weight_map(cfg), src.ckpt)
    return check_parity(hf_dir, chunks, ctx_holder["ctx"], cfg.vocab_size, seq_len=SEQ_LEN).max_abs_diff


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=pathlib.Path)
    ap.add_argument("result", type=pathlib.Path)
    ap.add_argument("--quick", action="store_true", help="one GLM-5 shape: convert, parity, export only")
    args = ap.parse_args()

    import torch

    report: dict = {"unshimmed_rotate_error": unshimmed_rotate_fails(), "shapes": {}, "mutations": {}}
    from checkpoints_tools import common
    from checkpoints_tools.hf_to_mcore import convert_hf_to_mcore
    from checkpoints_tools.mcore_to_hf import convert_mcore_to_hf
    from checkpoints_tools.parity import run_check

    torch.set_grad_enabled(False)
    shapes = {"glm5_shared_idx_mtp": mla_fixtures.SHAPES["glm5_shared_idx_mtp"]} if args.quick else mla_fixtures.SHAPES
    for name, hub in shapes.items():
        base = args.work / name
        hf_dir = mla_fixtures.write_hf_dir(name, base / "hf")
        mcore = convert_hf_to_mcore(hf_dir, base / "mcore", progress=False)
        res = run_check(hf_dir, mcore, seq_len=SEQ_LEN)
        convert_mcore_to_hf(mcore, base / "hf_out", hf_template=hf_dir, max_shard_bytes=40_000, progress=False)
        r = report["shapes"][name] = dataclasses.asdict(res)
        if "index_topk" in hub and not args.quick:
            r["sparse_effect"] = sparse_effect(hf_dir)
    if args.quick:
        args.result.write_text(json.dumps(report, indent=2))
        return
    from sao_megatron.parallel.bootstrap import init_distributed

    holder = {"ctx": init_distributed(common.parallel_config(common.read_model_config(
        args.work / "glm5_full_idx" / "mcore"), 1, 1, 1), seed=0)}
    muts = report["mutations"]
    dsv3 = args.work / "dsv3_yarn_groups_mtp" / "hf"
    muts["dsv3_no_yarn"] = mutated_parity(dsv3, holder, cfg_changes={"rope_type": "rope"})
    muts["dsv3_no_groups"] = mutated_parity(dsv3, holder, cfg_changes={"moe_router_num_groups": None,
                                                                       "moe_router_group_topk": None})
    muts["glm5_k_norm_swapped"] = mutated_parity(args.work / "glm5_full_idx" / "hf", holder, swap_k_norm=True)
    muts["glm5_rotation_off"] = mutated_parity(args.work / "glm5_full_idx" / "hf", holder,
                                                cfg_changes={"dsa_indexer_rotate_activation": False})
    args.result.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
