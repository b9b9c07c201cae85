"""`sao-megatron convert hf-to-mcore | mcore-to-hf | check`.

Multi-rank layouts run under torchrun, e.g.
``torchrun --nproc-per-node 4 -m sao_megatron.cli convert hf-to-mcore --hf-dir D --out-dir O --tp 2 --ep 2``.
Bad input is one error line on stderr and exit code 2; a failed parity check exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys


def _layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size to run at (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to run at (default 1)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size to run at (default 1)")
    p.add_argument("--etp", type=int, default=None, help="tensor-parallel size inside experts (default: --tp)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert between Hugging Face and Megatron checkpoints, check logits parity")
    verbs = p.add_subparsers(dest="direction", metavar="ACTION", required=True)

    a = verbs.add_parser("hf-to-mcore", help="HF safetensors -> Megatron distributed checkpoint")
    a.add_argument("--hf-dir", required=True, help="Hugging Face model directory (config.json + safetensors)")
    a.add_argument("--out-dir", required=True, help="new directory for the Megatron checkpoint")
    _layout_args(a)
    a.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="parameter dtype of the checkpoint (default: the HF config's dtype)")
    a.add_argument("--dry-run", action="store_true", help="validate and print the mapping and shapes; write nothing")
    a.add_argument("--overwrite", action="store_true", help="replace a non-empty --out-dir")
    a.set_defaults(func=run_hf_to_mcore)

    b = verbs.add_parser("mcore-to-hf", help="Megatron checkpoint -> HF safetensors + index + template files")
    b.add_argument("--mcore-dir", required=True, help="directory written by `convert hf-to-mcore`")
    b.add_argument("--hf-template", default=None,
                   help="HF directory whose config.json/tokenizer files are copied (default: generate config.json)")
    b.add_argument("--out-dir", required=True, help="new directory for the HF model")
    _layout_args(b)
    b.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="dtype of the written tensors (default: the template's, else the checkpoint's)")
    b.add_argument("--max-shard-mb", type=int, default=5000, help="safetensors shard size limit (MiB)")
    b.add_argument("--overwrite", action="store_true", help="replace a non-empty --out-dir")
    b.set_defaults(func=run_mcore_to_hf)

    c = verbs.add_parser("check", help="fp32 logits parity: HF transformers vs the Megatron checkpoint")
    c.add_argument("--hf-dir", required=True, help="Hugging Face model directory")
    c.add_argument("--mcore-dir", required=True, help="Megatron checkpoint directory")
    _layout_args(c)
    c.add_argument("--tol", type=float, default=1e-4, help="max abs logits difference allowed (default 1e-4)")
    c.add_argument("--batch-size", type=int, default=2, help="random sequences (default 2)")
    c.add_argument("--seq-len", type=int, default=24, help="tokens per sequence (default 24)")
    c.add_argument("--seed", type=int, default=0, help="seed of the random tokens")
    c.set_defaults(func=run_check)


def _rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _guard(fn):
    """Bad input -> one line on stderr, exit code 2 (no traceback)."""
    def wrapped(args: argparse.Namespace) -> int:
        from sao_megatron.models.families import ConversionError

        try:
            return fn(args)
        except (ConversionError, ValueError) as exc:
            print(f"sao-megatron convert {args.direction}: error: {exc}", file=sys.stderr)
            return 2
    return wrapped


@_guard
def run_hf_to_mcore(args: argparse.Namespace) -> int:
    from checkpoints_tools.hf_to_mcore import convert_hf_to_mcore, mapping_table, open_hf

    if args.dry_run:
        src = open_hf(args.hf_dir, dtype=args.dtype)
        if _rank0():
            print("\n".join(mapping_table(src)))
        return 0
    out = convert_hf_to_mcore(args.hf_dir, args.out_dir, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp,
                              dtype=args.dtype, overwrite=args.overwrite)
    if _rank0():
        print(f"wrote Megatron checkpoint {out}")
    return 0


@_guard
def run_mcore_to_hf(args: argparse.Namespace) -> int:
    from checkpoints_tools.mcore_to_hf import convert_mcore_to_hf

    out = convert_mcore_to_hf(args.mcore_dir, args.out_dir, hf_template=args.hf_template, tp=args.tp, pp=args.pp,
                              ep=args.ep, etp=args.etp, dtype=args.dtype, max_shard_bytes=args.max_shard_mb << 20,
                              overwrite=args.overwrite)
    if _rank0():
        print(f"wrote HF model {out}")
    return 0


@_guard
def run_check(args: argparse.Namespace) -> int:
    from checkpoints_tools.parity import run_check as check

    res = check(args.hf_dir, args.mcore_dir, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, batch=args.batch_size,
                seq_len=args.seq_len, seed=args.seed)
    ok = res.ok(args.tol)
    if _rank0():
        print(f"logits max_abs_diff={res.max_abs_diff:.3e} mean_abs_diff={res.mean_abs_diff:.3e} "
              f"(max |logit| {res.max_abs_logit:.3f}, tol {args.tol:g}): {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1
