"""Skip-observation GAE: the vectorised implementation vs a per-timestep loop vs a plain copy.

    python benchmarks/advantages.py [--batch 128] [--lengths 4096 32768] [--reps 10] [--threads N]
    python benchmarks/advantages.py --device cuda [--json OUT.json] [--no-loop]

Prints, side by side in one run, for multi-turn masks at each T:
  - ``gae``: ``sao_megatron.algorithms.advantages.gae`` (skip_observations=True) as callers get it:
    on CPU tensors the fused numba kernel (``impl="kernel"``, algorithms/gae_cpu.py);
  - ``gae:out``: the same, writing into preallocated outputs (``out=``), like the copy below;
  - ``scan``: the same function with ``impl="scan"``, the vectorised compaction + blocked scan that
    runs on accelerators (timed here on CPU for comparison);
  - ``loop``: the same recursion as a Python loop over time on batch tensors, the shape used by
    verl's ``compute_gae_advantage_return`` (multi-turn variant) and OpenRLHF's ``get_advantages_and_returns``;
  - ``copy``: copying the bytes GAE reads (rewards, values, action_mask) into preallocated tensors:
    the memory-bound floor (the faster of back-to-back and interleaved timings);
and the ratios loop/gae (target >= 100x at T=32k) and gae/copy, gae:out/copy (target <= 5x).
A second table times the scan kernels alone on a [B, T] float32 tensor (why the blocked scan is used).

``--device cuda`` (or any other torch device) times ``gae`` as callers get it there (``impl="auto"``:
the scan off the CPU; on CPU the kernel, or the scan where numba is absent) against a device copy
of the same bytes, checks it against the CPU scan's result, and with ``--json`` writes those rows
(scripts/gpu_check.sh compares a GPU run with a CPU run of this mode). ``--no-loop`` leaves out
the per-timestep loop (seconds per call at T=32k).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from sao_megatron.algorithms.advantages import discounted_reverse_cumsum, gae

GAMMA, LAM = 0.99, 0.95


def multi_turn_batch(batch: int, length: int, seed: int = 0):
    """Right-padded rows of alternating action runs (policy turns) and observation runs (tool output).

    Each row fills a random 50-100% of T; the per-turn reward sits on each turn's last action token.
    """
    gen = np.random.default_rng(seed)
    mask = np.zeros((batch, length), dtype=bool)
    rewards = np.zeros((batch, length), dtype=np.float32)
    for b in range(batch):
        end, t = int(gen.integers(length // 2, length + 1)), int(gen.integers(0, 64))  # prompt tail
        while t < end:
            turn = int(gen.integers(32, 1024))
            mask[b, t:min(t + turn, end)] = True
            rewards[b, min(t + turn, end) - 1] = gen.standard_normal()
            t += turn + int(gen.integers(16, 512))
    values = gen.standard_normal((batch, length)).astype(np.float32)
    return torch.from_numpy(rewards), torch.from_numpy(values), torch.from_numpy(mask)


def loop_gae(rewards, values, mask, gamma: float, lam: float):
    """Per-timestep reverse loop over batch tensors, skipping observation tokens (verl multi-turn shape)."""
    batch, length = rewards.shape
    maskf = mask.to(rewards.dtype)
    next_value = rewards.new_zeros(batch)
    last_gae = rewards.new_zeros(batch)
    reversed_adv = []
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_value = values[:, t] * maskf[:, t] + (1 - maskf[:, t]) * next_value
        last_gae = gae_t * maskf[:, t] + (1 - maskf[:, t]) * last_gae
        reversed_adv.append(last_gae)
    advantages = torch.stack(reversed_adv[::-1], dim=1) * maskf
    return advantages, (advantages + values) * maskf


def timeit(fn, reps: int, warmup: int = 1) -> float:
    """Best wall time in ms over reps calls (after warmup calls).

    The minimum, not the median: the 2-core box is shared, and other processes only ever add time.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def timeit_interleaved(fns, reps: int) -> list[float]:
    """Best wall time in ms of each function, calling them in turn rep after rep (after one warm-up
    call each), so that a slow spell on the shared box hits every column alike."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return [1e3 * t for t in best]


def lfilter_scan(x: torch.Tensor, discount: float) -> torch.Tensor:
    import scipy.signal  # only this CPU comparison needs scipy (GPU images need not ship it)

    reversed_rows = x.numpy()[:, ::-1]
    out = scipy.signal.lfilter([1.0], [1.0, -discount], reversed_rows, axis=1)
    return torch.from_numpy(np.ascontiguousarray(out[:, ::-1]))


def gae_table(batch: int, lengths: list[int], reps: int) -> None:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"GAE, skip-observation, B={batch}, float32, gamma={GAMMA}, lam={LAM}, "
          f"threads={torch.get_num_threads()}, cpus={os.cpu_count()}, load average {load}")
    print(f"{'T':>6} {'action%':>8} {'gae ms':>7} {'gae:out':>8} {'scan ms':>8} {'loop ms':>8} {'copy ms':>8} "
          f"{'loop/gae':>9} {'gae/copy':>9} {'out/copy':>9} {'scan/copy':>10} {'max|diff|':>10}")
    for length in lengths:
        rewards, values, mask = multi_turn_batch(batch, length)
        buffers = [torch.empty_like(x) for x in (rewards, values, mask)]  # preallocated: no page faults
        out = (torch.empty_like(rewards), torch.empty_like(rewards))
        gae_ms, out_ms, scan_ms, copy_ms = timeit_interleaved([
            lambda: gae(rewards, values, mask, gamma=GAMMA, lam=LAM),
            lambda: gae(rewards, values, mask, gamma=GAMMA, lam=LAM, out=out),
            lambda: gae(rewards, values, mask, gamma=GAMMA, lam=LAM, impl="scan"),
            lambda: [b.copy_(x) for b, x in zip(buffers, (rewards, values, mask))]], reps)
        # The floor is the copy at its fastest: back to back it finds more of its bytes in cache
        # than between GAE calls, and into huge-page buffers (as gae's fresh CPU outputs are) it
        # takes fewer TLB misses; take the smallest (the stricter ratio).
        huge = [torch.from_numpy(np.empty(tuple(x.shape), dtype=x.numpy().dtype)) for x in (rewards, values, mask)]
        for dst in (buffers, huge):
            copy_ms = min(copy_ms, timeit(lambda: [b.copy_(x) for b, x in zip(dst, (rewards, values, mask))], reps))
        loop_reps = 2 if length > 8192 else reps  # ~3 s per call at T=32k
        loop_ms = timeit(lambda: loop_gae(rewards, values, mask, GAMMA, LAM), loop_reps, warmup=0)
        theirs = loop_gae(rewards, values, mask, GAMMA, LAM)
        outputs = (gae(rewards, values, mask, gamma=GAMMA, lam=LAM), out,
                   gae(rewards, values, mask, gamma=GAMMA, lam=LAM, impl="scan"))
        diff = max((a - b).abs().max().item() for ours in outputs for a, b in zip(ours, theirs))
        print(f"{length:>6} {100 * mask.float().mean().item():>7.1f}% {gae_ms:>7.2f} {out_ms:>8.2f} {scan_ms:>8.2f} "
              f"{loop_ms:>8.0f} {copy_ms:>8.2f} {loop_ms / gae_ms:>8.0f}x {gae_ms / copy_ms:>8.1f}x "
              f"{out_ms / copy_ms:>8.1f}x {scan_ms / copy_ms:>9.1f}x {diff:>10.2e}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_rows(batch: int, lengths: list[int], reps: int, device: torch.device, *, loop: bool) -> list[dict]:
    """``gae`` (impl auto) on ``device`` vs a device copy of its inputs; max |difference| vs the CPU result."""
    from sao_megatron.algorithms.advantages import gae_impl_for

    rows = []
    for length in lengths:
        cpu = multi_turn_batch(batch, length)
        rewards, values, mask = (x.to(device) for x in cpu)
        buffers = [torch.empty_like(x) for x in (rewards, values, mask)]

        def run_gae():
            out = gae(rewards, values, mask, gamma=GAMMA, lam=LAM)
            _sync(device)
            return out

        def run_copy():
            [b.copy_(x) for b, x in zip(buffers, (rewards, values, mask))]
            _sync(device)

        gae_ms, copy_ms = timeit_interleaved([run_gae, run_copy], reps)
        ref = gae(*cpu, gamma=GAMMA, lam=LAM, impl="scan")  # the CPU scan: the same maths everywhere
        diff = max(float((a.cpu() - b).abs().max()) for a, b in zip(run_gae(), ref))
        row = {"length": length, "device": str(device), "impl": gae_impl_for(rewards), "gae_ms": gae_ms,
               "copy_ms": copy_ms, "max_diff_vs_cpu": diff}
        if loop:
            row["loop_ms"] = timeit(lambda: (loop_gae(rewards, values, mask, GAMMA, LAM), _sync(device)), 1, warmup=0)
        rows.append(row)
        print(f"T={length:>6} on {device}: gae ({row['impl']}) {gae_ms:.2f} ms, copy {copy_ms:.2f} ms "
              f"({gae_ms / copy_ms:.1f}x), max |{device} - cpu scan| {diff:.1e}"
              + (f", loop {row['loop_ms']:.0f} ms" if loop else ""))
    return rows


def scan_table(batch: int, length: int, reps: int) -> None:
    x = torch.randn(batch, length)
    discount = GAMMA * LAM
    print(f"\nScan kernels alone, [{batch}, {length}] float32, discount={discount:.4f}")
    out = torch.empty_like(x)
    rows = [("copy (floor)", lambda: out.copy_(x)),
            ("scipy.signal.lfilter (reversed rows)", lambda: lfilter_scan(x, discount))]
    rows += [(f"blocked scan, chunk={c}", (lambda c=c: discounted_reverse_cumsum(x, discount, chunk=c)))
             for c in (8, 16, 32, 64, 128)]
    # GAE with V = 0 and every token an action is exactly this scan (δ = r, Â_t = δ_t + γλ Â_{t+1}).
    zeros, ones = torch.zeros_like(x), torch.ones_like(x, dtype=torch.bool)
    assert torch.allclose(gae(x, zeros, ones, gamma=discount, lam=1.0)[0], discounted_reverse_cumsum(x, discount),
                          atol=1e-3)
    rows.append(("fused GAE kernel (V=0, all actions)", lambda: gae(x, zeros, ones, gamma=discount, lam=1.0)))
    base = None
    for name, fn in rows:
        ms = timeit(fn, reps)
        base = base or ms
        print(f"  {name:<38} {ms:8.2f} ms  {ms / base:6.1f}x copy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", default=None, help="time gae on this device only (e.g. cuda); see above")
    parser.add_argument("--json", default=None, help="with --device: write the rows to this file")
    parser.add_argument("--no-loop", action="store_true", help="with --device: skip the per-timestep loop")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device:
        rows = device_rows(args.batch, args.lengths, args.reps, torch.device(args.device), loop=not args.no_loop)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"batch": args.batch, "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)
        return
    gae_table(args.batch, args.lengths, args.reps)
    scan_table(args.batch, max(args.lengths), args.reps)


if __name__ == "__main__":
    main()
