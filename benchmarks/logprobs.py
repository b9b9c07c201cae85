"""Per-token log-probs + entropy: chunked autograd Function vs the previous all-at-once version.

Both run side by side in one process on the same [b, s, V] logits (TP=1, the rank-local shape at
TP>1 is [b, s, V/TP]), forward with entropy and a backward of a random linear combination of
log-probs and entropy (what the actor loss does). Reported per implementation:

- saved for backward: bytes of the unique storages autograd keeps between forward and backward
  (torch.autograd.graph.saved_tensors_hooks; the input logits count when they are saved);
- peak extra: the allocator's high-water mark during forward + backward above what was allocated
  before (logits excluded, the returned gradient included). On CUDA torch.cuda.max_memory_allocated;
  on CPU the profiler's allocator events (profile_memory=True, every CPU tensor allocation and free
  with a running total), not RSS, which the allocator's caching and the OS make noisy;
- time: median wall time of forward+backward, and of a no-grad forward (the old-log-prob pass).

    python benchmarks/logprobs.py                         # [1, 2048, 32768] bf16, seconds on 2 cores
    python benchmarks/logprobs.py --shape 1 4096 151936   # Qwen3 vocabulary at TP=1 (needs ~15 GB)
    python benchmarks/logprobs.py --device cuda --shape 1 4096 151936
    python benchmarks/logprobs.py --device cuda --json OUT.json   # the numbers as JSON too (gpu_check.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sao_megatron.models.actor import DEFAULT_CHUNK_ELEMENTS, token_logprobs


def old_token_logprobs(logits_bsv, tokens_bs, *, vocab_size, temperature=1.0, with_entropy=True):
    """The implementation before the chunked Function (TP=1 path, verbatim maths), the baseline."""
    logits = logits_bsv[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets_n = tokens_bs[:, 1:]
    v_local = logits.shape[-1]
    valid_v = torch.arange(0, v_local, device=logits.device) < vocab_size
    logits = logits.masked_fill(~valid_v, torch.finfo(logits.dtype).min)
    row_max = logits.detach().amax(dim=-1)
    shifted = logits - row_max.unsqueeze(-1)
    exp = torch.where(valid_v, shifted.exp(), 0.0)
    sum_exp = exp.sum(dim=-1)
    log_z = sum_exp.log()
    in_slice = (targets_n >= 0) & (targets_n < v_local)
    picked = shifted.gather(-1, targets_n.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    lp = torch.where(in_slice, picked, 0.0) - log_z
    ent = None
    if with_entropy:
        expected = torch.where(valid_v, exp * shifted, 0.0).sum(dim=-1)
        ent = log_z - expected / sum_exp
    zero = lp.new_zeros(lp.shape[0], 1)
    return torch.cat([zero, lp], 1), (torch.cat([zero, ent], 1) if ent is not None else None)


def _loss(fn, logits, tokens, weights):
    lp, ent = fn(logits, tokens)
    return (weights[0] * lp).sum() + (weights[1] * ent).sum()


def saved_bytes(fn, logits, tokens, weights) -> int:
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _loss(fn, logits, tokens, weights)
    del loss
    return sum(storages.values())


def peak_extra_bytes(fn, logits, tokens, weights) -> int:
    def step():
        (grad,) = torch.autograd.grad(_loss(fn, logits, tokens, weights), logits)
        return grad

    if logits.is_cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        grad = step()
        torch.cuda.synchronize()
        del grad
        return torch.cuda.max_memory_allocated() - base
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        del_grad = step()
        del del_grad
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events
              if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]
    return max(totals, default=0)


def wall_ms(fn, logits, tokens, weights, *, reps: int, backward: bool) -> float:
    times = []
    for _ in range(reps + 1):  # the first is a warm-up, dropped
        _sync(logits)
        t0 = time.perf_counter()
        if backward:
            torch.autograd.grad(_loss(fn, logits, tokens, weights), logits)
        else:
            with torch.no_grad():
                fn(logits, tokens)
        _sync(logits)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[1:])


def _sync(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=3, default=[1, 2048, 32768], metavar=("B", "S", "V"))
    parser.add_argument("--pad", type=int, default=64, help="trailing vocab columns that are TP padding")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--chunk-elements", type=int, default=DEFAULT_CHUNK_ELEMENTS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    args = parser.parse_args()

    b, s, v = args.shape
    gen = torch.Generator(device=args.device).manual_seed(0)
    logits = torch.randn(b, s, v, generator=gen, device=args.device).mul_(3).to(getattr(torch, args.dtype))
    logits.requires_grad_(True)
    tokens = torch.randint(0, v - args.pad, (b, s), generator=gen, device=args.device)
    weights = torch.randn(2, b, s, generator=gen, device=args.device)
    impls = {
        "old": lambda x, t: old_token_logprobs(x, t, vocab_size=v - args.pad, temperature=args.temperature),
        "chunked": lambda x, t: token_logprobs(x, t, tp_group=None, vocab_size=v - args.pad,
                                               temperature=args.temperature, chunk_elements=args.chunk_elements),
    }
    agree = _check_agree(impls, logits, tokens, weights)
    rows = {}
    for name, fn in impls.items():
        rows[name] = (saved_bytes(fn, logits, tokens, weights), peak_extra_bytes(fn, logits, tokens, weights),
                      wall_ms(fn, logits, tokens, weights, reps=args.reps, backward=True),
                      wall_ms(fn, logits, tokens, weights, reps=args.reps, backward=False))
    _report(args, logits, rows)
    if args.json:
        names = ("saved_mib", "peak_extra_mib", "fwd_bwd_ms", "fwd_ms")
        scale = (2.0**-20, 2.0**-20, 1.0, 1.0)
        with open(args.json, "w") as f:
            json.dump({"shape": list(logits.shape), "dtype": args.dtype, "device": args.device, "agree": agree,
                       "rows": {impl: {k: v * c for k, v, c in zip(names, row, scale)} for impl, row in rows.items()}},
                      f, indent=1)


def _check_agree(impls, logits, tokens, weights) -> bool:
    """Both implementations must give the same numbers before their costs are compared (printed if not)."""
    outs = []
    for fn in impls.values():
        lp, ent = fn(logits, tokens)
        (grad,) = torch.autograd.grad((weights[0] * lp).sum() + (weights[1] * ent).sum(), logits)
        outs.append((lp.detach(), ent.detach(), grad.float()))
    try:
        for a, b in zip(outs[0], outs[1]):
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-4)
    except AssertionError as exc:
        print(f"the implementations disagree: {exc}")
        return False
    return True


def _report(args, logits, rows) -> None:
    mib = 2.0**20
    print(f"logits {list(logits.shape)} {args.dtype} on {args.device} ({logits.nbytes / mib:.1f} MiB), "
          f"pad {args.pad}, temperature {args.temperature}, chunk {args.chunk_elements} elements, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'impl':<8} {'saved MiB':>10} {'peak extra MiB':>15} {'fwd+bwd ms':>11} {'fwd no-grad ms':>15}")
    for name, (saved, peak, fb, fwd) in rows.items():
        print(f"{name:<8} {saved / mib:>10.1f} {peak / mib:>15.1f} {fb:>11.1f} {fwd:>15.1f}")
    (so, po, fbo, fo), (sn, pn, fbn, fn) = rows["old"], rows["chunked"]
    print(f"{'old/new':<8} {so / sn:>9.1f}x {po / pn:>14.1f}x {fbo / fbn:>10.2f}x {fo / fn:>14.2f}x")


if __name__ == "__main__":
    main()
