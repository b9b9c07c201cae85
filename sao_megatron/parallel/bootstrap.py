"""Parallel bootstrap: torch.distributed + Megatron parallel state from torchrun or Slurm.

This is the only module that reads Megatron's global ``parallel_state``: it
returns a ``ParallelContext`` (ranks, sizes and process groups) that is passed
explicitly to everything below (model builders, optimizers, forward helpers).
Backends: gloo without a GPU (after the CPU shims), NCCL with one.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import random
import re
import subprocess
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from sao_megatron.config.schema import ParallelConfig
from sao_megatron.errors import SaoError
from sao_megatron import net
from sao_megatron.net import free_port

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class LaunchEnv:
    """Where this process sits in the job and how to reach rank 0."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of processes."""
    local_rank: int
    """Rank on this node (selects the GPU)."""
    master_addr: str
    """Host of rank 0."""
    master_port: int
    """TCP port of the rendezvous on rank 0."""
    source: str
    """'torchrun', 'slurm' or 'single'."""


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the launcher's variables: torchrun's RANK/WORLD_SIZE/... first, then Slurm's, else one process."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                         local_rank=int(env.get("LOCAL_RANK", 0)),
                         master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                         master_port=int(env.get("MASTER_PORT", 29500)), source="torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        return LaunchEnv(rank=int(env["SLURM_PROCID"]), world_size=int(env["SLURM_NTASKS"]),
                         local_rank=int(env.get("SLURM_LOCALID", 0)),
                         master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist),
                         master_port=int(env.get("MASTER_PORT") or slurm_port(env.get("SLURM_JOB_ID", "0"))),
                         source="slurm")
    return LaunchEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                     master_port=free_port(), source="single")


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list: ``scontrol show hostnames`` when available, else own parsing."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return expand_first_host(nodelist)


def expand_first_host(nodelist: str) -> str:
    """``'node[03-05,7],gpu1'`` -> ``'node03'`` (first entry; zero padding kept)."""
    first = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if first is None:
        raise ValueError(f"cannot parse Slurm node list {nodelist!r}; set MASTER_ADDR explicitly")
    prefix, bracket = first.group(1), first.group(3)
    if bracket is None:
        return prefix
    return prefix + bracket.split(",")[0].split("-")[0]


def slurm_port(job_id: str) -> int:
    """The master port of a job launched by srun without the node runner (which sets MASTER_PORT):
    the job's own port block, outside this node's ephemeral range, so concurrent jobs do not collide
    and no client socket the kernel handed out can hold it."""
    job = int(re.sub(r"\D", "", job_id) or 0)
    return net.port_base(job, net.ephemeral_port_range()) + net.MASTER_PORT_OFFSET


@dataclasses.dataclass(kw_only=True, slots=True)
class ParallelContext:
    """Ranks, sizes and process groups of this process; passed explicitly below the bootstrap."""

    parallel: ParallelConfig
    """The layout this context was built from."""
    rank: int
    """Global rank."""
    world_size: int
    """Number of processes."""
    local_rank: int
    """Rank on this node."""
    device: torch.device
    """cuda:<local_rank> on GPU machines, cpu otherwise."""
    tp_rank: int
    """Tensor-parallel rank."""
    pp_rank: int
    """Pipeline stage."""
    dp_rank: int
    """Data-parallel rank (dense parameters)."""
    ep_rank: int
    """Expert-parallel rank."""
    etp_rank: int
    """Expert tensor-parallel rank."""
    expt_dp_rank: int
    """Data-parallel rank of expert parameters."""
    dp_size: int
    """Data-parallel size (dense parameters)."""
    expt_dp_size: int
    """Data-parallel size of expert parameters."""
    pg: ProcessGroupCollection
    """Every Megatron process group (tp, pp, ep, expt_tp, dp, dp_cp, expt_dp, ...)."""

    @property
    def tp_size(self) -> int:
        return self.parallel.tensor_model_parallel_size

    @property
    def pp_size(self) -> int:
        return self.parallel.pipeline_model_parallel_size

    @property
    def ep_size(self) -> int:
        return self.parallel.expert_model_parallel_size

    @property
    def etp_size(self) -> int:
        return self.parallel.expert_tensor_parallel_size or self.parallel.tensor_model_parallel_size

    @property
    def vpp_size(self) -> int | None:
        return self.parallel.virtual_pipeline_model_parallel_size

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.pg.tp

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.pg.pp

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.pg.dp_cp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def check_world_size(parallel: ParallelConfig, world_size: int) -> None:
    """ValueError unless the layout tiles ``world_size`` processes."""
    tp, pp, cp = (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                  parallel.context_parallel_size)
    etp = parallel.expert_tensor_parallel_size or tp
    ep = parallel.expert_model_parallel_size
    if world_size % (tp * pp * cp):
        raise ValueError(f"world size {world_size} is not divisible by TP*PP*CP={tp * pp * cp}: launch a "
                         f"multiple of {tp * pp * cp} processes or change parallel.*_parallel_size")
    if world_size % (etp * ep * pp):
        raise ValueError(f"world size {world_size} is not divisible by expert-TP*EP*PP={etp * ep * pp}: "
                         f"change parallel.expert_model_parallel_size or expert_tensor_parallel_size")


class DeviceError(SaoError):
    """``resources.device`` asks for a device this node cannot provide."""


def cuda_problem(local_rank: int) -> str | None:
    """Why this process cannot train on ``cuda:<local_rank>``, or None when it can."""
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support"
    with warnings.catch_warnings(record=True) as caught:  # e.g. "the NVIDIA driver on your system is too old"
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    if not available:
        told = "; ".join(str(w.message).splitlines()[0] for w in caught)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return f"torch.cuda.is_available() is False{where}" + (f": {told}" if told else
                                                                  ": no GPU visible or a driver/wheel mismatch")
    if local_rank >= torch.cuda.device_count():
        return f"local rank {local_rank} but only {torch.cuda.device_count()} GPU(s) visible on this node"
    return None


def resolve_device(setting: str, local_rank: int) -> torch.device:
    """``resources.device`` -> this process's device. ``cuda`` fails with the reason when CUDA is
    unusable; ``auto`` falls back to the CPU with one warning line; ``cpu`` never touches CUDA."""
    if setting == "cpu":
        return torch.device("cpu")
    if setting not in ("auto", "cuda"):
        raise ValueError(f"resources.device={setting!r} must be auto, cuda or cpu")
    problem = cuda_problem(local_rank)
    if problem is None:
        return torch.device("cuda", local_rank)
    if setting == "cuda":
        raise DeviceError(f"resources.device=cuda but CUDA is unusable here: {problem}. Fix the node (driver, "
                          "CUDA_VISIBLE_DEVICES, a torch wheel built for this driver) or set resources.device=cpu")
    logger.warning("resources.device=auto: CUDA is unusable (%s): this process trains on the CPU", problem)
    return torch.device("cpu")


def init_distributed(parallel: ParallelConfig, *, seed: int, device: str = "auto",
                     environ: Mapping[str, str] | None = None) -> ParallelContext:
    """Start torch.distributed (if needed) and Megatron's model parallel state; seed all RNGs.

    ``device``: ``resources.device`` (auto | cuda | cpu). The backend (NCCL on CUDA, gloo on the
    CPU), the CPU shims and Megatron's initialisation device follow it. Reuses an already
    initialised default process group (e.g. a test harness).
    """
    from megatron.core import parallel_state as mpu

    from sao_megatron.parallel.cpu_support import apply_cpu_shims

    env = launch_env(environ)
    dev = resolve_device(device, env.local_rank)
    has_gpu = dev.type == "cuda"
    if not has_gpu:
        apply_cpu_shims(force=True)
    else:
        torch.cuda.set_device(env.local_rank)
    timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if has_gpu else "gloo", rank=env.rank, world_size=env.world_size,
                                init_method=f"tcp://{env.master_addr}:{env.master_port}", timeout=timeout)
    world = dist.get_world_size()
    check_world_size(parallel, world)
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        distributed_timeout_minutes=parallel.distributed_timeout_minutes)
    ctx = _context_from_mpu(parallel, env, dev)
    seed_all(seed, ctx)
    logger.info("rank %d/%d (%s, %s): tp %d/%d pp %d/%d ep %d/%d etp %d/%d dp %d/%d", ctx.rank, world,
                env.source, dist.get_backend(), ctx.tp_rank, ctx.tp_size, ctx.pp_rank, ctx.pp_size,
                ctx.ep_rank, ctx.ep_size, ctx.etp_rank, ctx.etp_size, ctx.dp_rank, ctx.dp_size)
    return ctx


def _context_from_mpu(parallel: ParallelConfig, env: LaunchEnv, device: torch.device) -> ParallelContext:
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ParallelContext(
        parallel=parallel, rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=env.local_rank,
        device=device, tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(with_context_parallel=True),
        ep_rank=mpu.get_expert_model_parallel_rank(), etp_rank=mpu.get_expert_tensor_parallel_rank(),
        expt_dp_rank=mpu.get_expert_data_parallel_rank(),
        dp_size=mpu.get_data_parallel_world_size(with_context_parallel=True),
        expt_dp_size=mpu.get_expert_data_parallel_world_size(),
        pg=ProcessGroupCollection.use_mpu_process_groups())


def seed_all(seed: int, ctx: ParallelContext) -> None:
    """Python/torch seeds offset per pipeline stage (as Megatron does) + the model-parallel RNG tracker.

    The tracker gives TP ranks distinct streams inside TP regions and identical ones outside.
    """
    from megatron.core import tensor_parallel

    stage_seed = seed + 100 * ctx.pp_rank
    random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def destroy() -> None:
    """Tear down Megatron's parallel state and the default process group (safe to call twice)."""
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
