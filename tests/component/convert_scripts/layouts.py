"""Under torchrun (4 processes, gloo): the converted checkpoints at TP2xEP2 and PP2.

For each shape (HF dir + TP1 Megatron checkpoint already written by roundtrip.py):
- parity after loading the TP1 checkpoint at TP2xEP2 and at PP2;
- export (mcore-to-hf) at TP2xEP2 and at PP2 with tiny buckets (compared with the
  TP1 export and the original files by the test);
- streaming export to *all* ranks at TP2xEP2: every rank's tensors equal the HF files;
- hf-to-mcore straight at TP2xEP2 (sharded import), then parity of that checkpoint at PP2;
- for ETP_SHAPE, TP2xEP2 with expert-TP 1 (the shipped GPU layouts' shape): import then parity
  at PP2, and export (compared with the original files by the test).
Rank 0 writes a JSON report. Usage: torchrun --nproc-per-node 4 layouts.py WORK RESULT --shapes a,b
"""

from __future__ import annotations

import argparse
import json
import pathlib

ETP_SHAPE = "glm_gqa2_dense0_shared1"  # shared experts are TP-sharded, routed experts not: two groups


def hf_files_equal_on_every_rank(hf_dir: pathlib.Path, mcore: pathlib.Path) -> bool:
    """Stream at TP2xEP2 to all ranks; compare each rank's tensors with the original safetensors."""
    import torch
    import torch.distributed as dist
    from safetensors import safe_open

    from checkpoints_tools import common
    from sao_megatron.models.families import get_family
    from sao_megatron.weights.export import ExportPlan, iter_hf_tensors

    cfg = common.read_model_config(mcore)
    _, chunks = common.bootstrap(cfg, 2, 1, 2)
    common.load_megatron(mcore, chunks)
    plan = ExportPlan(chunks, get_family(cfg.family).weight_map(cfg), bucket_bytes=20_000)
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    seen, ok = set(), len(plan.buckets) > 3
    for name, tensor in iter_hf_tensors(plan, receivers="all"):
        with safe_open(str(hf_dir / index[name]), "pt") as f:
            ok &= torch.equal(f.get_tensor(name), tensor)
        seen.add(name)
    ok &= seen == set(index)
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=pathlib.Path)
    ap.add_argument("result", type=pathlib.Path)
    ap.add_argument("--shapes", required=True)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    from checkpoints_tools.hf_to_mcore import convert_hf_to_mcore
    from checkpoints_tools.mcore_to_hf import convert_mcore_to_hf
    from checkpoints_tools.parity import run_check

    torch.set_grad_enabled(False)
    report: dict = {}
    for name in args.shapes.split(","):
        base = args.work / name
        hf_dir, mcore = base / "hf", base / "mcore"
        r = report[name] = {}
        r["tp2ep2"] = run_check(hf_dir, mcore, tp=2, ep=2).max_abs_diff
        r["pp2"] = run_check(hf_dir, mcore, pp=2).max_abs_diff
        convert_mcore_to_hf(mcore, base / "hf_tp2ep2", hf_template=hf_dir, tp=2, ep=2, bucket_bytes=20_000,
                            max_shard_bytes=40_000, progress=False)
        convert_mcore_to_hf(mcore, base / "hf_pp2", hf_template=hf_dir, pp=2, bucket_bytes=20_000,
                            progress=False)
        r["all_ranks_equal"] = hf_files_equal_on_every_rank(hf_dir, mcore)
        sharded = convert_hf_to_mcore(hf_dir, base / "mcore_tp2ep2", tp=2, ep=2, progress=False)
        r["import_tp2ep2_then_pp2"] = run_check(hf_dir, sharded, pp=2).max_abs_diff
        if name == ETP_SHAPE:
            etp1 = convert_hf_to_mcore(hf_dir, base / "mcore_tp2ep2etp1", tp=2, ep=2, etp=1, progress=False)
            r["import_tp2ep2etp1_then_pp2"] = run_check(hf_dir, etp1, pp=2).max_abs_diff
            convert_mcore_to_hf(mcore, base / "hf_tp2ep2etp1", hf_template=hf_dir, tp=2, ep=2, etp=1,
                                bucket_bytes=20_000, progress=False)
    if dist.get_rank() == 0:
        args.result.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
