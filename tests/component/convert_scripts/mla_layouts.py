"""Under torchrun (4 processes, gloo): the MLA/DSA checkpoints written by mla_roundtrip.py at TP2xEP2 and PP2.

Per shape: parity of the TP1 checkpoint loaded at TP2xEP2 and at PP2, export at TP2xEP2
(compared bit for bit with the original files by the test), and hf-to-mcore straight at
TP2xEP2 then parity at PP2. Usage: torchrun --nproc-per-node 4 mla_layouts.py WORK RESULT --shapes a,b
"""

from __future__ import annotations

import argparse
import json
import pathlib

SEQ_LEN = 32


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
        r["tp2ep2"] = run_check(hf_dir, mcore, tp=2, ep=2, seq_len=SEQ_LEN).max_abs_diff
        r["pp2"] = run_check(hf_dir, mcore, pp=2, seq_len=SEQ_LEN).max_abs_diff
        convert_mcore_to_hf(mcore, base / "hf_tp2ep2", hf_template=hf_dir, tp=2, ep=2, bucket_bytes=20_000,
                            max_shard_bytes=40_000, progress=False)
        sharded = convert_hf_to_mcore(hf_dir, base / "mcore_tp2ep2", tp=2, ep=2, progress=False)
        r["import_tp2ep2_then_pp2"] = run_check(hf_dir, sharded, pp=2, seq_len=SEQ_LEN).max_abs_diff
    if dist.get_rank() == 0:
        args.result.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
