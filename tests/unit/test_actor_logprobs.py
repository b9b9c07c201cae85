"""Chunked vocab-parallel log-probs/entropy (models.actor) against a float64 full log_softmax.

The reference slices the unpadded vocabulary, applies the temperature and runs
torch.log_softmax in float64; gradients come from autograd through it. TP > 1 is
exercised with threads standing in for ranks (a barrier-based all-reduce), which
checks the cross-rank combination of the statistics and that each rank's
gradient is its slice of the full one.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as torch_dist

from sao_megatron.models import actor
from sao_megatron.models.actor import token_logprobs, vocab_parallel_logprobs

pytestmark = pytest.mark.unit


def _reference(logits_bsv: torch.Tensor, tokens_bs: torch.Tensor, vocab: int, temperature: float):
    """(logprobs [b, s], entropy [b, s]) in float64, column 0 = 0; differentiable w.r.t. logits."""
    logp = torch.log_softmax(logits_bsv[:, :-1, :vocab].double() / temperature, dim=-1)
    lp = logp.gather(-1, tokens_bs[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    zero = lp.new_zeros(lp.shape[0], 1)
    return torch.cat([zero, lp], 1), torch.cat([zero, ent], 1)


def _case(b=3, s=7, v_padded=40, vocab=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s, v_padded, generator=g) * 3
    logits[..., vocab:] = 1e4  # padding columns must not leak into the softmax
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    tokens[0, 1], tokens[-1, 2], tokens[-1, -1] = vocab - 1, 0, vocab - 1  # both ends of the valid range
    weights = torch.randn(2, b, s, generator=g, dtype=torch.float64)
    return logits, tokens, weights


def _grad(fn, logits, weights):
    x = logits.detach().clone().requires_grad_(True)
    lp, ent = fn(x)
    loss = (weights[0] * lp.double()).sum() + (weights[1] * ent.double()).sum()
    return lp.detach(), ent.detach(), torch.autograd.grad(loss, x)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_elements", [37, 3 * 37, 5 * 37 + 10, 2 * 7 * 37, actor.DEFAULT_CHUNK_ELEMENTS])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_float64_log_softmax(dtype, chunk_elements, temperature):
    logits, tokens, weights = _case()
    logits = logits.to(dtype)
    lp, ent, grad = _grad(lambda x: token_logprobs(x, tokens, tp_group=None, vocab_size=37, temperature=temperature,
                                                   chunk_elements=chunk_elements), logits, weights)
    ref_lp, ref_ent, ref_grad = _grad(lambda x: _reference(x, tokens, 37, temperature), logits.double(), weights)
    assert lp.dtype == ent.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    tol = 1e-5 if dtype == torch.float32 else 2**-7  # bf16 gradient: one rounding of the result
    torch.testing.assert_close(grad.double(), ref_grad, rtol=tol, atol=1e-5)
    assert grad[..., 37:].abs().sum() == 0 and grad[:, -1].abs().sum() == 0


@pytest.mark.parametrize("weights_used", ["logprobs_only", "entropy_only"])
def test_gradient_when_only_one_output_feeds_the_loss(weights_used):
    logits, tokens, weights = _case(seed=1)
    weights[1 if weights_used == "logprobs_only" else 0] = 0
    _, _, grad = _grad(lambda x: token_logprobs(x, tokens, tp_group=None, vocab_size=37, chunk_elements=50),
                       logits, weights)
    _, _, ref_grad = _grad(lambda x: _reference(x, tokens, 37, 1.0), logits.double(), weights)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-6)


def test_without_entropy_returns_none_and_the_logprob_gradient():
    logits, tokens, weights = _case(seed=2)
    x = logits.clone().requires_grad_(True)
    lp, ent = token_logprobs(x, tokens, tp_group=None, vocab_size=37, temperature=1.3, with_entropy=False,
                             chunk_elements=100)
    assert ent is None
    grad = torch.autograd.grad((weights[0] * lp.double()).sum(), x)[0]
    ref = x.detach().double().requires_grad_(True)
    ref_grad = torch.autograd.grad((weights[0] * _reference(ref, tokens, 37, 1.3)[0]).sum(), ref)[0]
    torch.testing.assert_close(lp.double(), _reference(logits.double(), tokens, 37, 1.3)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-6)


def test_vocab_parallel_logprobs_on_rows_with_any_leading_shape():
    logits, tokens, _ = _case(b=2, s=6, seed=3)
    lp, ent = vocab_parallel_logprobs(logits.reshape(12, 40), tokens.reshape(12), tp_group=None, vocab_size=37,
                                      temperature=0.5, chunk_elements=80)
    logp = torch.log_softmax(logits[..., :37].double() / 0.5, -1)
    torch.testing.assert_close(lp.double(), logp.gather(-1, tokens[..., None]).reshape(12), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), -(logp.exp() * logp).sum(-1).reshape(12), rtol=1e-5, atol=1e-5)
    lp4, _ = vocab_parallel_logprobs(logits.reshape(2, 2, 3, 40), tokens.reshape(2, 2, 3), tp_group=None,
                                     vocab_size=37, temperature=0.5)
    torch.testing.assert_close(lp4.reshape(12), lp)


def test_target_in_the_padding_gets_minus_infinity():
    logits, tokens, _ = _case(b=1, s=3)
    tokens[0, 2] = 38
    lp, _ = token_logprobs(logits, tokens, tp_group=None, vocab_size=37)
    assert lp[0, 2] == float("-inf") and torch.isfinite(lp[0, :2]).all()


def test_gradcheck_float64():
    logits, tokens, _ = _case(b=2, s=4, v_padded=6, vocab=5, seed=4)
    logits[..., 5:] = 0.3  # gradcheck perturbs every entry, the padding too: it must be inert
    x = logits.double().requires_grad_(True)

    def fn(t):
        return token_logprobs(t, tokens, tp_group=None, vocab_size=5, temperature=0.8, chunk_elements=10)

    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-7, rtol=1e-6)


def test_saves_only_the_input_logits_and_per_row_stats_for_backward():
    logits = torch.randn(2, 64, 1000, dtype=torch.bfloat16, requires_grad=True)
    tokens = torch.randint(0, 990, (2, 64))
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(logits, tokens, tp_group=None, vocab_size=990, temperature=0.9)
    per_row_budget = 64 * logits.shape[0] * logits.shape[1]  # a handful of 8-byte numbers per row
    assert logits.untyped_storage().data_ptr() in storages
    assert sum(storages.values()) <= logits.untyped_storage().nbytes() + per_row_budget


def test_chunk_elements_must_be_positive():
    logits, tokens, _ = _case()
    with pytest.raises(ValueError, match="chunk_elements"):
        token_logprobs(logits, tokens, tp_group=None, vocab_size=37, chunk_elements=0)


class _ThreadRanks:
    """Stands in for torch.distributed over ``size`` threads (rank = thread-local), MAX/SUM all-reduce."""

    ReduceOp = torch_dist.ReduceOp

    def __init__(self, size: int):
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=60)
        self.local = threading.local()

    def is_initialized(self) -> bool:
        return True

    def get_rank(self, group) -> int:
        return self.local.rank

    def get_world_size(self, group) -> int:
        return self.size

    def all_reduce(self, tensor, op, group=None) -> None:
        self.slots[self.local.rank] = tensor.clone()
        self.barrier.wait()
        stacked = torch.stack(self.slots)
        reduced = stacked.amax(0) if op == torch_dist.ReduceOp.MAX else stacked.sum(0)
        self.barrier.wait()  # everyone has read the slots before they are reused
        tensor.copy_(reduced)


@pytest.mark.parametrize("tp, v_local, vocab", [(2, 20, 37), (3, 8, 15)])  # (3, 8, 15): rank 2 is all padding
def test_tensor_parallel_slices_combine_to_the_full_softmax(monkeypatch, tp, v_local, vocab):
    logits, tokens, weights = _case(v_padded=tp * v_local, vocab=vocab, seed=5)
    ranks = _ThreadRanks(tp)
    monkeypatch.setattr(actor, "dist", ranks)
    results, errors = [None] * tp, []

    def run(rank: int) -> None:
        ranks.local.rank = rank
        try:
            part = logits[..., rank * v_local:(rank + 1) * v_local]
            results[rank] = _grad(lambda x: token_logprobs(x, tokens, tp_group=object(), vocab_size=vocab,
                                                           temperature=0.7, chunk_elements=30), part, weights)
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)
            ranks.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    ref_lp, ref_ent, ref_grad = _grad(lambda x: _reference(x, tokens, vocab, 0.7), logits.double(), weights)
    for lp, ent, _ in results:
        torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    grad = torch.cat([r[2] for r in results], dim=-1)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-6)
