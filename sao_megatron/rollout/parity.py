"""Log-prob parity: what the engine reported vs a fresh recomputation of the same tokens.

First gate (here): the embedded engine against Hugging Face transformers on the
same HF directory; in fp32 on CPU the gap is ~1e-6. The Megatron actor gate
reuses ``generate_with_engine`` and ``logprob_gap`` with its own recomputation.

Recomputation follows the engine's reported quantity (``engine/sampling.py``):
``log softmax(logits / T)`` of the token at the position that predicts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import torch

from sao_megatron.rollout.client import RolloutClient
from sao_megatron.rollout.engine.sampling import LogprobMode, RowParams, reference_logprob
from sao_megatron.rollout.launch import LocalEngines
from sao_megatron.rollout.types import GenerateResult, SamplingParams


def generate_with_engine(model_dir: str | Path, prompts: Sequence[list[int]], sampling: SamplingParams, *,
                         engine_urls: list[str] | None = None, api_key: str | None = None) -> list[GenerateResult]:
    """Generate one completion per prompt (concurrently); starts a local engine unless ``engine_urls`` is given."""
    async def run(urls: list[str]) -> list[GenerateResult]:
        async with RolloutClient(urls, api_key=api_key) as client:
            return list(await asyncio.gather(*(client.generate(list(p), sampling) for p in prompts)))

    if engine_urls:
        return asyncio.run(run(engine_urls))
    with LocalEngines(model_dir, 1, api_key=api_key) as engines:
        return asyncio.run(run(engines.urls))


@torch.inference_mode()
def hf_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int], sampling: SamplingParams,
                mode: LogprobMode = "sglang") -> list[float]:
    """Log-probs of ``output`` after ``prompt`` from one full forward of an HF causal LM (no cache)."""
    if not output:
        return []
    logits_tv = model(input_ids=torch.tensor([prompt + output[:-1]])).logits[0].float()
    params = RowParams.normalised(sampling.temperature, sampling.top_p, sampling.top_k)
    first = len(prompt) - 1  # the position that predicts output[0]
    return [reference_logprob(logits_tv[first + i], tok, params, mode) for i, tok in enumerate(output)]


def logprob_gap(reference: Sequence[Sequence[float]], results: Sequence[GenerateResult]) -> dict[str, float]:
    """mean/max |reference − engine| over all tokens: ``{"parity/mean_abs", "parity/max_abs", "parity/num_tokens"}``."""
    diffs = [abs(a - b) for ref, res in zip(reference, results, strict=True)
             for a, b in zip(ref, res.logprobs, strict=True)]
    if not diffs:
        return {"parity/mean_abs": 0.0, "parity/max_abs": 0.0, "parity/num_tokens": 0}
    return {"parity/mean_abs": sum(diffs) / len(diffs), "parity/max_abs": max(diffs), "parity/num_tokens": len(diffs)}


def hf_parity(model_dir: str | Path, prompts: Sequence[list[int]], sampling: SamplingParams, *,
              engine_urls: list[str] | None = None, api_key: str | None = None) -> dict[str, float]:
    """Generate with the engine, recompute with HF transformers (fp32), report the log-prob gap."""
    from sao_megatron.rollout.engine.model import load_hf_model

    results = generate_with_engine(model_dir, prompts, sampling, engine_urls=engine_urls, api_key=api_key)
    model = load_hf_model(model_dir)
    reference = [hf_logprobs(model, list(p), r.output_ids, sampling) for p, r in zip(prompts, results)]
    return logprob_gap(reference, results)
