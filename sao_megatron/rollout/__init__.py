"""Rollout layer: SGLang client, embedded CPU engine, routing, and the weight wire both sides speak
(update groups, loader groups, checksums); pushing weights is ``sao_megatron.weights``'.

Import the light parts from here; ``engine`` (torch + transformers) and ``launch`` are imported from
their modules.
"""

from sao_megatron.rollout.client import RolloutClient
from sao_megatron.rollout.types import (
    EngineError,
    EngineReplyError,
    EngineTimeout,
    EngineUnavailable,
    GenerateResult,
    SamplingParams,
)

__all__ = ["RolloutClient", "SamplingParams", "GenerateResult", "EngineError", "EngineUnavailable",
           "EngineReplyError", "EngineTimeout"]
