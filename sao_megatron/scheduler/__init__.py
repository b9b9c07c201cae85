"""Asynchronous single-rollout scheduling: samples, staleness accounting, partial rollouts."""

from __future__ import annotations

from sao_megatron.scheduler.episode import EpisodeDiscarded, EpisodeFailed
from sao_megatron.scheduler.prompts import PromptCursor, PromptRef
from sao_megatron.scheduler.sample import Sample, collate, demonstration_sample
from sao_megatron.scheduler.scheduler import AsyncScheduler

__all__ = ["AsyncScheduler", "EpisodeDiscarded", "EpisodeFailed", "PromptCursor", "PromptRef", "Sample",
           "collate", "demonstration_sample"]
