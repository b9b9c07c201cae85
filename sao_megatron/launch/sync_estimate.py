"""Weight-sync arithmetic per sender and per receiving engine rank (``sao-megatron plan``, docs/scaling.md).

A pure function of the model, trainer-parallel and resources configs. Model of the
``distributed`` transport (``weights/distributed.py``) on SGLang 0.5.23:
- senders: one owner per (PP stage, EP rank); the owner of EP rank 0 of a stage also sends the
  stage's dense tensors (TP shards gathered first), so the busiest sender holds
  ``max over stages (dense + routed_experts / EP)`` (embedding on the first stage, head on the last);
- every sender sends its slice to every engine (one group per sender and engine), so its link
  carries ``sender_bytes * num_engines``;
- every receiving rank of an engine gets every full tensor (SGLang broadcasts whole tensors
  to ``rank_offset + tp_rank`` and each rank keeps its shard), so each engine GPU's link
  carries the whole model, whatever the number of senders;
- the sync takes the longer of the two at ``link_gbps`` per GPU (no protocol overhead).
``sharded_*`` is the same arithmetic if each engine rank pulled only the shard it keeps
(1 / rollout_tp_size of the bytes): what a per-rank transfer (RDMA pulls, remote-instance
loading) would reach, which unpatched SGLang cannot.
"""

from __future__ import annotations

from dataclasses import dataclass

from sao_megatron.config.schema import ModelConfig, ParallelConfig, ResourcesConfig
from sao_megatron.launch.planner import Layout, count_params, stage_params

BYTES_PER_PARAM = 2  # bf16 export


@dataclass(frozen=True, slots=True)
class SyncEstimate:
    """Bytes and seconds of one weight sync (all engines updated once)."""

    total_bytes: float
    """The HF export, bf16."""
    num_senders: int
    sender_bytes_max: float
    """Bytes the busiest sender owns (it sends them to every engine)."""
    num_engines: int
    engine_rank_bytes: float
    """Bytes every receiving GPU of every engine gets (the whole model on SGLang)."""
    link_gbps: float
    sender_seconds: float
    engine_seconds: float
    sharded_engine_rank_bytes: float
    sharded_seconds: float

    @property
    def seconds(self) -> float:
        return max(self.sender_seconds, self.engine_seconds)


def estimate_sync(m: ModelConfig, p: ParallelConfig, r: ResourcesConfig) -> SyncEstimate:
    """The arithmetic above for one config (``resources.link_gbps``: Gb/s per GPU)."""
    total = count_params(m, divisible_by=1).total
    pp, ep = p.pipeline_model_parallel_size, p.expert_model_parallel_size if m.num_moe_experts else 1
    whole = Layout(nodes=1, gpus_per_node=pp, tp=1, pp=pp, ep=1, etp=1, vpp=p.virtual_pipeline_model_parallel_size)
    sender = 0.0
    for stage in range(pp):  # full (gathered) tensors of the stage; a tied lm_head copy is not exported
        groups = stage_params(m, whole, stage, critic=False, divisible_by=1)
        dense = sum(groups.values()) - groups["routed_experts"] - (
            0 if m.untie_embeddings_and_output_weights else groups["lm_head"])
        sender = max(sender, BYTES_PER_PARAM * (dense + groups["routed_experts"] / ep))
    engines = max(1, r.rollout_nodes * r.gpus_per_node // r.rollout_tp_size) if r.rollout_nodes else 1
    rate = r.link_gbps * 1e9 / 8
    total_bytes = BYTES_PER_PARAM * total
    sharded = total_bytes / r.rollout_tp_size
    return SyncEstimate(
        total_bytes=float(total_bytes), num_senders=pp * ep, sender_bytes_max=sender, num_engines=engines,
        engine_rank_bytes=float(total_bytes), link_gbps=r.link_gbps, sender_seconds=sender * engines / rate,
        engine_seconds=total_bytes / rate, sharded_engine_rank_bytes=sharded,
        sharded_seconds=max(sender * engines / rate, sharded / rate))


def describe(e: SyncEstimate) -> str:
    """Two lines for ``sao-megatron plan``."""
    return (f"weight sync (distributed, {e.link_gbps:g} Gb/s per GPU): {e.num_senders} senders, the busiest sends "
            f"{e.sender_bytes_max / 1e9:.1f} GB to each of {e.num_engines} engines ({e.sender_seconds:.1f} s); "
            f"each engine GPU receives {e.engine_rank_bytes / 1e9:.1f} GB ({e.engine_seconds:.1f} s) -> "
            f"~{e.seconds:.1f} s per sync\n"
            f"  if each engine rank pulled only its shard: {e.sharded_engine_rank_bytes / 1e9:.1f} GB per GPU, "
            f"~{e.sharded_seconds:.1f} s")
