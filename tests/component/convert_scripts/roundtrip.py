"""One process, many shapes: HF fixture -> Megatron checkpoint -> parity -> HF export, plus mutations.

Run by tests/component/test_convert.py (one launch amortises the ~10 s import);
writes a JSON report that the test asserts on. Usage:
    python roundtrip.py WORK_DIR RESULT_JSON --shapes a,b --mutate a
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import hf_fixtures  # noqa: E402


def fixture_reload_diff(name: str, hf_dir: pathlib.Path) -> float:
    """The saved hub-style directory must load in transformers as the in-memory model it came from."""
    import torch
    from transformers import AutoModelForCausalLM

    tokens = torch.randint(0, hf_fixtures.SHAPES[name]["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(3))
    ref = hf_fixtures.build_model(hf_fixtures.SHAPES[name])(input_ids=tokens).logits
    loaded = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    return float((loaded.eval()(input_ids=tokens).logits - ref).abs().max())


def gate_up_swapped(family):
    """The family's mapping with gate_proj/up_proj exchanged in every [gate; up] rule."""
    from sao_megatron.models.families.base import GATE_UP

    rules = tuple(r.__class__(r.mcore, r.hf[::-1], r.hf_shapes[::-1], r.transform, r.when)
                  if r.transform == GATE_UP else r for r in family.rules)
    return family.with_rules(rules)


def direct_load_parity(hf_dir: pathlib.Path) -> dict:
    """The trainer's start-from-HF path (sharded.load_hf_dir, no checkpoint files), and its config guard."""
    import dataclasses

    from checkpoints_tools import common
    from checkpoints_tools.parity import check_parity
    from sao_megatron.models.families import ConversionError, model_config_from_hf
    from sao_megatron.models.families.sharded import load_hf_dir

    cfg = model_config_from_hf(hf_dir)
    ctx, chunks = common.bootstrap(cfg, 1, 1, 1)
    load_hf_dir(chunks, cfg, hf_dir)
    try:
        load_hf_dir(chunks, dataclasses.replace(cfg, rotary_percent=1.0), hf_dir)
        rejected = ""
    except ConversionError as exc:
        rejected = str(exc)
    return {"max_abs_diff": check_parity(hf_dir, chunks, ctx, cfg.vocab_size).max_abs_diff, "rejected": rejected}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=pathlib.Path)
    ap.add_argument("result", type=pathlib.Path)
    ap.add_argument("--shapes", default=",".join(hf_fixtures.SHAPES))
    ap.add_argument("--mutate", default="")
    args = ap.parse_args()

    import torch

    from checkpoints_tools.hf_to_mcore import convert_hf_to_mcore, open_hf
    from checkpoints_tools.mcore_to_hf import convert_mcore_to_hf
    from checkpoints_tools.parity import parity_of_mapping, run_check

    torch.set_grad_enabled(False)
    report: dict = {"shapes": {}, "mutations": {}}
    for name in filter(None, args.shapes.split(",")):
        base = args.work / name
        hf_dir = hf_fixtures.write_hf_dir(name, base / "hf")
        mcore = convert_hf_to_mcore(hf_dir, base / "mcore", progress=False)
        res = run_check(hf_dir, mcore)
        convert_mcore_to_hf(mcore, base / "hf_out", hf_template=hf_dir, max_shard_bytes=40_000, progress=False)
        report["shapes"][name] = {"max_abs_diff": res.max_abs_diff, "mean_abs_diff": res.mean_abs_diff,
                                  "max_abs_logit": res.max_abs_logit,
                                  "fixture_reload_diff": fixture_reload_diff(name, hf_dir)}
    report["load_hf_dir"] = direct_load_parity(args.work / "glm_mha_qknorm_shared2" / "hf")
    for name in filter(None, args.mutate.split(",")):
        hf_dir = args.work / name / "hf"
        res = parity_of_mapping(hf_dir, gate_up_swapped(open_hf(hf_dir).family))
        report["mutations"][name] = {"max_abs_diff": res.max_abs_diff}
    args.result.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
