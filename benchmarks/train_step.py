"""The actor's and the critic's training step of a ~1B-parameter MoE: tokens/s, TFLOP/s, MFU, memory,
and where the step's time goes, side by side with HF transformers eager on the same shape (issue 37).

    python benchmarks/train_step.py                           # CUDA: the ~1B shape; CPU: the tiny one
    python benchmarks/train_step.py --device cuda --shape 1b --json OUT.json   # what gpu_check.sh runs
    python benchmarks/train_step.py --device cpu --shape tiny --steps 2        # the CI test's shape

What runs is the project's own step: models built by ``models.builder`` (local specs, or Transformer
Engine where usable), Megatron DDP and optimizer from ``training.step.optim``, one RL batch
(``LocalBatch``) of ``--microbatches`` sequences of ``--seq-len`` tokens through
``training.step.rl_step.actor_update`` (SAO: DIS policy loss on critic-GAE advantages, entropy) and
``critic_update`` (value loss; the critic trains ``critic.trainable``: experts and value head), in
bf16 with fp32 master weights and fp32 gradient reduction, exactly as ``sao-megatron train`` does.
Warm-up steps first, then ``--steps`` timed ones.

Phases: Megatron's schedule calls ``forward_step`` (model forward + loss) and ``backward_step``
per micro-batch, then ``config.finalize_model_grads_func`` (gradient reduction over DP/EP, and the
embedding/norm syncs), then the trainer calls ``optimizer.step()`` (grad norm, clipping, Adam,
master -> model copy). Each is bracketed by CUDA events (wall clock on the CPU); the rest of the
step (zeroing grads, the loss all-reduce, the LR schedule) is ``other``. The shares add up to 1.
Peak memory (CUDA) is the process's over the timed steps, with both roles' weights, gradients and
optimizer states resident, as in the trainer (no offloading).

FLOPs (model FLOPs, counted from the built model's parameters, not from a config formula):
``N_fwd`` = every matmul weight a token passes through, routed experts weighted by top-k / experts,
shared experts, router and LM head (or value head) in full, the input embedding (a lookup) not
counted; ``N_wgrad`` = those of them that train. Per micro-batch of T tokens in rows of s tokens,
causal attention in L layers of n_h heads of d_h dims (half of the s x s scores are useful):

    forward  = 2·N_fwd·T + 2·L·n_h·d_h·s·T
    backward = 2·N_fwd·T + 2·N_wgrad·T + 2·(2·L·n_h·d_h·s·T)      (input grads + weight grads)

so a fully trained model costs 6·N·T + 6·L·n_h·d_h·s·T per step (PaLM's estimate, appendix B,
with the causal half). For the critic (frozen embedding and attention) it is an upper bound: autograd
also skips the first layer's attention backward, whose inputs and weights need no gradient. The step's FLOPs are the forward and backward calls that really ran (an
objective that recomputes old log-probs adds a forward). TFLOP/s = FLOPs / step time; MFU = that
over the GPU's dense bf16 peak (``PEAK_BF16_TFLOPS``; ``--peak-tflops`` for another device).

The baseline: the same shape as a transformers ``Qwen3MoeForCausalLM`` (eager attention, bf16,
``model(input_ids, labels=...)`` loss, torch AdamW on the bf16 weights) timed the same way; its
FLOPs are the actor's. It has no critic counterpart. ``--baseline none`` leaves it out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import json
import pathlib
import statistics
import time
from collections import defaultdict

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "experiments" / "tiny_cpu.yaml"
SHAPES = {
    # ~1.1B parameters, ~0.4B active per token (Qwen3-MoE-shaped: GQA with q/k norm, 16 experts top-4,
    # untied 151936-token vocabulary), sequences of 2048 tokens, 8 per step (16k tokens).
    "1b": dict(overrides=["model.num_layers=14", "model.hidden_size=1024", "model.ffn_hidden_size=3072",
                          "model.num_attention_heads=16", "model.num_query_groups=4", "model.kv_channels=128",
                          "model.num_moe_experts=16", "model.moe_ffn_hidden_size=1024", "model.moe_router_topk=4",
                          "model.vocab_size=151936", "model.max_position_embeddings=4096",
                          "model.rotary_base=1000000"], seq_len=2048, microbatches=8),
    # configs/models/tiny_moe.yaml as it is (2 layers, hidden 64, 4 experts top-2): seconds on a CPU.
    "tiny": dict(overrides=[], seq_len=128, microbatches=2),
}
PEAK_BF16_TFLOPS = {
    # Dense (no structured sparsity) BF16 Tensor Core peaks, NVIDIA's datasheets (H100 Tensor Core GPU,
    # H200, A100, GH200, B200, L40S), where the sparse figure is quoted: half of it. Matched in order
    # on torch.cuda.get_device_name(), the most specific first.
    "GH200": 989.0, "H200": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H800": 989.0,
    "B200": 2250.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
}
PHASES = ("forward", "backward", "grad_reduce", "optimizer", "other")


def peak_for(device_name: str) -> float | None:
    """Dense bf16 peak TFLOP/s of a CUDA device name (``PEAK_BF16_TFLOPS``), None when unlisted."""
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_name), None)


def peak_tflops(device: torch.device, override: float | None) -> tuple[str, float | None]:
    """(device name, dense bf16 peak TFLOP/s or None when unknown: the CPU, an unlisted GPU)."""
    if device.type != "cuda":
        return f"cpu ({torch.get_num_threads()} threads)", override
    name = torch.cuda.get_device_name(device)
    return name, override if override is not None else peak_for(name)


# ---------------------------------------------------------------- timing


class Timeline:
    """Marks ``phase:start`` / ``phase:end`` on the device's timeline; ``totals`` sums each interval
    into the phase it opened (after an ``:end``, or before the first mark: ``other``)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []
        self.calls: dict[str, int] = defaultdict(int)

    def mark(self, label: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((label, event))
        else:
            self.marks.append((label, time.perf_counter()))

    def wrap(self, fn, phase: str):
        def timed(*args, **kwargs):
            self.calls[phase] += 1
            self.mark(f"{phase}:start")
            try:
                return fn(*args, **kwargs)
            finally:
                self.mark(f"{phase}:end")
        return timed

    def totals(self) -> dict[str, float]:
        """Seconds per phase between the first and the last mark."""
        if self.cuda:
            torch.cuda.synchronize()
        out = dict.fromkeys(PHASES, 0.0)
        for (label, t0), (_, t1) in itertools.pairwise(self.marks):
            seconds = t0.elapsed_time(t1) / 1e3 if self.cuda else t1 - t0
            out[label.removesuffix(":start") if label.endswith(":start") else "other"] += seconds
        return out


@contextlib.contextmanager
def instrumented(timeline: Timeline, ddp_chunks, optimizer):
    """Bracket Megatron's per-micro-batch forward/backward, the gradient reduction and the optimizer
    step with ``timeline`` marks (the schedule calls them through these names)."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import get_model_config

    config = get_model_config(ddp_chunks[0])
    saved = schedules.forward_step, schedules.backward_step, config.finalize_model_grads_func
    schedules.forward_step = timeline.wrap(saved[0], "forward")
    schedules.backward_step = timeline.wrap(saved[1], "backward")
    config.finalize_model_grads_func = timeline.wrap(saved[2], "grad_reduce")
    optimizer.step = timeline.wrap(optimizer.step, "optimizer")
    try:
        yield
    finally:
        schedules.forward_step, schedules.backward_step, config.finalize_model_grads_func = saved
        del optimizer.step  # the class's method again


def timed_steps(step, device: torch.device, *, warmup: int, steps: int, instrument) -> dict:
    """Run ``step()`` warmup + steps times; per timed step: seconds per phase and forward/backward
    calls; peak memory over the timed steps (CUDA)."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    per_step = []
    for _ in range(steps):
        timeline = Timeline(device)
        with instrument(timeline):
            timeline.mark("other:start")
            step()
            timeline.mark("other:end")
        per_step.append((timeline.totals(), dict(timeline.calls)))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    phases = {p: statistics.fmean(t[p] for t, _ in per_step) for p in PHASES}
    calls = per_step[-1][1]
    return {"phase_s": phases, "step_s": sum(phases.values()), "step_s_each": [sum(t.values()) for t, _ in per_step],
            "forward_calls": calls.get("forward", 0), "backward_calls": calls.get("backward", 0),
            "peak_mem_gib": peak}


# ---------------------------------------------------------------- FLOPs


@dataclasses.dataclass(kw_only=True, slots=True)
class FlopCount:
    """Model FLOPs of one forward and one backward of a micro-batch (module docstring)."""

    n_fwd: float
    """Matmul weights a token passes through (routed experts weighted by top-k / experts)."""
    n_wgrad: float
    """Those of them that train."""
    attn_fwd: float
    """2·L·n_h·d_h·s·T: the causal half of QK^T and PV of a micro-batch."""
    tokens: int
    """T: tokens of one micro-batch."""

    @property
    def forward(self) -> float:
        return 2 * self.n_fwd * self.tokens + self.attn_fwd

    @property
    def backward(self) -> float:
        return 2 * self.n_fwd * self.tokens + 2 * self.n_wgrad * self.tokens + 2 * self.attn_fwd


def count_flops(chunk: torch.nn.Module, model, *, seq_len: int, rows: int) -> FlopCount:
    """FlopCount of one [rows, seq_len] micro-batch through ``chunk`` (a GPTModel, DDP-unwrapped)."""
    active = model.moe_router_topk / model.num_moe_experts if model.num_moe_experts else 1.0
    n_fwd = n_wgrad = 0.0
    for name, p in chunk.named_parameters():
        if p.dim() < 2 or "word_embeddings" in name:
            continue  # norms and biases: O(h) per token; the embedding: a lookup
        n = p.numel() * (active if ".experts." in name else 1.0)
        n_fwd += n
        n_wgrad += n if p.requires_grad else 0.0
    if getattr(chunk, "share_embeddings_and_output_weights", False):  # the LM head is the embedding
        head = chunk.embedding.word_embeddings.weight
        n_fwd += head.numel()
        n_wgrad += head.numel() if head.requires_grad else 0.0
    d_h = model.kv_channels or model.hidden_size // model.num_attention_heads
    tokens = rows * seq_len
    attn = 2 * model.num_layers * model.num_attention_heads * d_h * seq_len * tokens
    return FlopCount(n_fwd=n_fwd, n_wgrad=n_wgrad, attn_fwd=attn, tokens=tokens)


def role_report(timing: dict, flops: FlopCount, *, tokens: int, peak: float | None) -> dict:
    """Throughput, TFLOP/s, MFU and phase shares of one role's timed steps."""
    total = timing["forward_calls"] * flops.forward + timing["backward_calls"] * flops.backward
    step_s = timing["step_s"]
    tflops = total / step_s / 1e12
    return {**timing, "tokens_per_step": tokens, "tokens_per_s": tokens / step_s, "flops_per_step": total,
            "tflops": tflops, "mfu": tflops / peak if peak else None,
            "share": {p: s / step_s for p, s in timing["phase_s"].items()}}


# ---------------------------------------------------------------- the project's step


def make_batch(cfg, *, seq_len: int, microbatches: int, device: torch.device):
    """A LocalBatch of ``microbatches`` rows of ``seq_len`` tokens: an eighth prompt, the rest the
    response (action tokens), a reward on the last token, rollout log-probs filled in later."""
    from sao_megatron.training.step.batch import LocalBatch, MicroBatch

    g = torch.Generator().manual_seed(0)
    prompt = seq_len // 8
    mbs = []
    for i in range(microbatches):
        mask = torch.zeros(1, seq_len)
        mask[:, prompt:] = 1.0
        rewards = torch.zeros(1, seq_len)
        rewards[0, -1] = float(torch.rand((), generator=g) > 0.5)
        mb = {"tokens": torch.randint(0, cfg.model.vocab_size, (1, seq_len), generator=g), "action_mask": mask,
              "token_rewards": rewards, "rollout_logprobs": torch.zeros(1, seq_len),
              "versions": torch.zeros(1, seq_len, dtype=torch.long), "row": torch.tensor([i])}
        mbs.append(MicroBatch(**{k: v.to(device) for k, v in mb.items()}))
    full = {"rewards": torch.stack([mb.token_rewards.sum().cpu() for mb in mbs]),
            "group_id": torch.arange(microbatches), "action_mask": torch.cat([mb.action_mask.cpu() for mb in mbs])}
    return LocalBatch(microbatches=mbs, full=full, num_tokens=int(full["action_mask"].sum()),
                      num_sequences=microbatches, device=device)


def build_role(cfg, ctx, role: str):
    """(chunks, ddp, optimizer, scheduler) the way the trainer builds a role."""
    from sao_megatron.models.builder import build_model_chunks
    from sao_megatron.models.critic import freeze_for_critic
    from sao_megatron.training.step.optim import setup_optimizer

    part = cfg.actor if role == "actor" else cfg.critic
    chunks = build_model_chunks(cfg.model, ctx, value_head=role == "critic", recompute=part.recompute_granularity)
    if role == "critic":
        freeze_for_critic(chunks, cfg.critic.trainable)
    ddp, opt, sched = setup_optimizer(chunks, part.optimizer, ctx, total_steps=1000)
    return argparse.Namespace(chunks=chunks, ddp=ddp, optimizer=opt, scheduler=sched)


def run_project(args, cfg, device: torch.device, peak: float | None) -> tuple[dict, FlopCount]:
    """Both roles' timed steps through training.step (one process, world size 1), and the actor's
    FlopCount (the baseline's too)."""
    from sao_megatron.parallel.bootstrap import destroy, init_distributed
    from sao_megatron.training.step import rl_step
    from sao_megatron.training.step.forward import compute_logprobs

    ctx = init_distributed(cfg.parallel, seed=0, device=device.type, environ={})
    actor, critic = build_role(cfg, ctx, "actor"), build_role(cfg, ctx, "critic")
    batch = make_batch(cfg, seq_len=args.seq_len, microbatches=args.microbatches, device=ctx.device)
    # The engines sampled from this policy: their log-probs are the actor's own (ratios near 1).
    own = compute_logprobs(actor.chunks, batch.microbatches, ctx=ctx, vocab_size=cfg.model.vocab_size)
    batch = dataclasses.replace(batch, microbatches=[mb.with_(rollout_logprobs=lp)
                                                     for mb, lp in zip(batch.microbatches, own, strict=True)])
    batch = rl_step.attach_advantages(batch, cfg.algorithm, rl_step.critic_values(critic, batch, ctx=ctx))
    settings = rl_step.PolicySettings(vocab_size=cfg.model.vocab_size, temperature=cfg.rollout.temperature,
                                      entropy_coef=cfg.actor.entropy_coef)
    steps = {"actor": lambda: rl_step.actor_update(actor, batch, cfg.algorithm, settings, ctx=ctx),
             "critic": lambda: rl_step.critic_update(critic, batch, ctx=ctx, value_clip=cfg.critic.value_clip)}
    tokens = args.seq_len * args.microbatches
    out, flop_counts = {}, {}
    for role, model in (("actor", actor), ("critic", critic)):
        timing = timed_steps(steps[role], ctx.device, warmup=args.warmup, steps=args.steps,
                             instrument=lambda tl, m=model: instrumented(tl, m.ddp, m.optimizer))
        flops = flop_counts[role] = count_flops(model.chunks[0], cfg.model, seq_len=args.seq_len, rows=1)
        out[role] = role_report(timing, flops, tokens=tokens, peak=peak) | {
            "params_total": sum(p.numel() for p in model.chunks[0].parameters()),
            "params_trainable": sum(p.numel() for p in model.chunks[0].parameters() if p.requires_grad),
            "params_active": flops.n_fwd}
    destroy()
    return out, flop_counts["actor"]


# ---------------------------------------------------------------- the HF transformers baseline


def run_hf(args, cfg, device: torch.device, flops_actor: FlopCount, peak: float | None) -> dict:
    """The same shape as transformers' Qwen3MoeForCausalLM, eager attention, bf16, AdamW."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sao_megatron.models.families import hf_config_from_model

    gc.collect()  # the project's models are gone: the peak memory below is the baseline's own
    if device.type == "cuda":
        torch.cuda.empty_cache()
    hf = dict(hf_config_from_model(cfg.model), use_cache=False)  # training: no KV cache
    hf_config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    torch.manual_seed(0)
    with device:  # initialised where it trains (1B random weights on the host take a while)
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager", dtype=torch.bfloat16)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, cfg.model.vocab_size, (1, args.seq_len), generator=g).to(device)
              for _ in range(args.microbatches)]
    timeline_box: list[Timeline] = []

    def step():
        tl = timeline_box[-1]
        opt.zero_grad(set_to_none=True)
        for t in tokens:
            loss = tl.wrap(lambda: model(input_ids=t, labels=t).loss / len(tokens), "forward")()
            tl.wrap(loss.backward, "backward")()
        tl.wrap(opt.step, "optimizer")()

    @contextlib.contextmanager
    def instrument(tl):
        timeline_box.append(tl)
        yield

    timeline_box.append(Timeline(device))  # the warm-up's (discarded)
    timing = timed_steps(step, device, warmup=args.warmup, steps=args.steps, instrument=instrument)
    tokens_per_step = args.seq_len * args.microbatches
    return role_report(timing, flops_actor, tokens=tokens_per_step, peak=peak) | {
        "params_total": sum(p.numel() for p in model.parameters())}


# ---------------------------------------------------------------- report


def fmt_role(name: str, r: dict) -> str:
    mem = f"{r['peak_mem_gib']:.1f} GiB" if r["peak_mem_gib"] is not None else "n/a (CPU)"
    mfu = f"{100 * r['mfu']:.1f} %" if r["mfu"] is not None else "n/a"
    shares = " ".join(f"{p} {100 * r['share'][p]:.0f}%" for p in PHASES)
    return (f"{name:<9} step {1e3 * r['step_s']:9.1f} ms  {r['tokens_per_s']:10.0f} tok/s  {r['tflops']:8.3g} TFLOP/s"
            f"  MFU {mfu:>7}  peak mem {mem}  [{shares}]")


def report(result: dict) -> None:
    print(f"train step on {result['device_name']}: shape {result['shape']}, {result['microbatches']} x "
          f"{result['seq_len']} tokens a step, {result['dtype']}, peak {result['peak_tflops'] or 'unknown'} TFLOP/s "
          f"dense bf16; actor {result['actor']['params_total'] / 1e6:.1f}M params, "
          f"{result['actor']['params_active'] / 1e6:.1f}M in matmuls a token")
    for role in ("actor", "critic", "hf_actor"):
        if role in result:
            print(fmt_role(role, result[role]))
    if "hf_actor" in result:
        ratio = result["hf_actor"]["step_s"] / result["actor"]["step_s"]
        print(f"actor vs HF transformers eager on the same shape: {ratio:.2f}x the throughput")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: 1b on CUDA, tiny on CPU")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens a sequence (default: the shape's)")
    parser.add_argument("--microbatches", type=int, default=None, help="sequences a step, one per micro-batch")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per role")
    parser.add_argument("--baseline", choices=["hf", "none"], default="hf")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of an unlisted device")
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    shape = SHAPES[args.shape or ("1b" if args.device == "cuda" else "tiny")]
    args.seq_len = args.seq_len or shape["seq_len"]
    args.microbatches = args.microbatches or shape["microbatches"]
    from sao_megatron.config import load_config

    cfg = load_config(CONFIG, [*shape["overrides"], "model.params_dtype=bf16", f"resources.device={args.device}",
                               f"model.max_position_embeddings={max(args.seq_len, 256)}"])
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    name, peak = peak_tflops(device, args.peak_tflops)
    roles, actor_flops = run_project(args, cfg, device, peak)
    result = {"device": args.device, "device_name": name, "peak_tflops": peak, "dtype": "bf16",
              "shape": args.shape or ("1b" if args.device == "cuda" else "tiny"), "seq_len": args.seq_len,
              "microbatches": args.microbatches, "steps": args.steps, **roles}
    if args.baseline == "hf":
        result["hf_actor"] = run_hf(args, cfg, device, actor_flops, peak)
    report(result)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
