"""Rollout layer: SGLang client, embedded CPU engine, routing, weight sync.

Import the light parts from here; ``engine`` (torch + transformers),
``launch`` and ``weight_sync`` are imported from their modules.
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
