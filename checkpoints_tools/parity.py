"""Logits parity: HF transformers vs the Megatron model on the same random tokens, in fp32.

The Megatron forward runs at any TP/EP/PP layout (one micro-batch; pipeline
stages hand the hidden states on with point-to-point sends), the vocab-parallel
logits are gathered over TP and the TP padding is cut, and rank 0 compares
them with the HF model's logits.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sao_megatron.models.families import ConversionError, Family, architecture_diff

from checkpoints_tools import common

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ParityResult:
    """Logit differences between the two models (rank 0's numbers, broadcast to all ranks)."""

    max_abs_diff: float
    mean_abs_diff: float
    max_abs_logit: float

    def ok(self, tol: float) -> bool:
        return self.max_abs_diff <= tol


def random_tokens(vocab_size: int, *, batch: int = 2, seq_len: int = 24, seed: int = 0) -> torch.Tensor:
    """[batch, seq_len] int64 token ids, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=gen)


@torch.no_grad()
def megatron_logits(chunks: list[torch.nn.Module], ctx, tokens_bs: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Full fp32 logits [b, s, vocab_size] on rank 0 (None elsewhere). Collective over the world."""
    if len(chunks) != 1:
        raise ConversionError("parity checks do not support virtual pipeline stages; use --pp without VPP")
    model, (b, s) = chunks[0], tokens_bs.shape
    tokens = tokens_bs.to(ctx.device)
    position_ids = torch.arange(s, device=ctx.device).expand(b, s)
    pp_ranks = dist.get_process_group_ranks(ctx.pp_group)
    if not ctx.is_first_stage:
        seq = s // ctx.tp_size if ctx.parallel.sequence_parallel else s
        hidden = torch.empty(seq, b, model.config.hidden_size, dtype=model.config.params_dtype, device=ctx.device)
        dist.recv(hidden, src=pp_ranks[ctx.pp_rank - 1])
        model.set_input_tensor(hidden)
    out = model(input_ids=tokens, position_ids=position_ids, attention_mask=None)
    if not ctx.is_last_stage:
        dist.send(out.contiguous(), dst=pp_ranks[ctx.pp_rank + 1])
    logits = None
    if ctx.is_last_stage:
        parts = [torch.empty_like(out) for _ in range(ctx.tp_size)]
        dist.all_gather(parts, out.contiguous(), group=ctx.tp_group)
        logits = torch.cat(parts, dim=-1)[..., :vocab_size].float().contiguous().cpu()
    return _to_rank0(logits, ctx, (b, s, vocab_size))


def _to_rank0(logits: torch.Tensor | None, ctx, shape: tuple[int, ...]) -> torch.Tensor | None:
    mine = ctx.rank if ctx.is_last_stage and ctx.tp_rank == 0 else ctx.world_size
    src = torch.tensor([mine], device=ctx.device)
    dist.all_reduce(src, op=dist.ReduceOp.MIN)
    src = int(src.item())
    if src == 0:
        return logits if ctx.rank == 0 else None
    if ctx.rank == src:
        dist.send(logits.to(ctx.device), dst=0)
    elif ctx.rank == 0:
        buf = torch.empty(shape, dtype=torch.float32, device=ctx.device)
        dist.recv(buf, src=src)
        return buf.cpu()
    return None


@torch.no_grad()
def hf_logits(hf_dir: str | pathlib.Path, tokens_bs: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, vocab] of the transformers model in fp32 (eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model(input_ids=tokens_bs).logits.float()


def compare(ref: torch.Tensor | None, got: torch.Tensor | None, ctx) -> ParityResult:
    """Rank 0 compares; every rank returns the same numbers."""
    stats = torch.zeros(3, dtype=torch.float64, device=ctx.device)
    if ctx.rank == 0:
        diff = (ref - got).abs()
        stats = torch.tensor([diff.max().item(), diff.mean().item(), ref.abs().max().item()],
                             dtype=torch.float64, device=ctx.device)
    dist.broadcast(stats, src=0)
    return ParityResult(*(float(x) for x in stats.tolist()))


def check_parity(hf_dir: str | pathlib.Path, chunks, ctx, vocab_size: int, *, batch: int = 2,
                 seq_len: int = 24, seed: int = 0) -> ParityResult:
    """HF vs the (already loaded) Megatron chunks on the same random tokens."""
    tokens = random_tokens(vocab_size, batch=batch, seq_len=seq_len, seed=seed)
    got = megatron_logits(chunks, ctx, tokens, vocab_size)
    ref = hf_logits(hf_dir, tokens) if ctx.rank == 0 else None
    return compare(ref, got, ctx)


def run_check(hf_dir: str | pathlib.Path, mcore_dir: str | pathlib.Path, *, tp: int = 1, pp: int = 1,
              ep: int = 1, etp: int | None = None, batch: int = 2, seq_len: int = 24, seed: int = 0) -> ParityResult:
    """Load the Megatron checkpoint in fp32 at the given layout and compare it with the HF model."""
    from checkpoints_tools.hf_to_mcore import open_hf

    model_cfg = dataclasses.replace(common.read_model_config(mcore_dir), params_dtype="fp32")
    hf_cfg = open_hf(hf_dir).model_cfg
    diffs = architecture_diff(model_cfg, hf_cfg)
    if diffs:
        raise ConversionError(f"{mcore_dir} and {hf_dir} describe different models: {'; '.join(diffs[:3])}")
    common.check_launch(tp, pp, ep, etp)
    ctx, chunks = common.bootstrap(model_cfg, tp, pp, ep, etp=etp)
    common.load_megatron(pathlib.Path(mcore_dir), chunks)
    return check_parity(hf_dir, chunks, ctx, model_cfg.vocab_size, batch=batch, seq_len=seq_len, seed=seed)


def parity_of_mapping(hf_dir: str | pathlib.Path, family: Family, *, batch: int = 2, seq_len: int = 24,
                      seed: int = 0) -> ParityResult:
    """Import ``hf_dir`` with ``family``'s mapping straight into a TP1 model and compare (no files)."""
    from checkpoints_tools.hf_to_mcore import open_hf
    from sao_megatron.models.families.sharded import load_hf_weights

    src = open_hf(hf_dir, dtype="fp32", family=family)
    ctx, chunks = common.bootstrap(src.model_cfg, 1, 1, 1)
    load_hf_weights(chunks, src.wmap, src.ckpt)
    return check_parity(hf_dir, chunks, ctx, src.model_cfg.vocab_size, batch=batch, seq_len=seq_len, seed=seed)
