"""What a process started by the trainer inherits: the environment without torchrun's variables.

torchrun gives every trainer rank its place in the trainer's world through the environment
(torch ``distributed/elastic/agent/server/local_elastic_agent.py``: ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE``, ...). A child of
a rank (an SGLang engine, the router, a reward worker) is not a rank of that world, but an inherited
copy says it is: a ``tcp://`` rendezvous under ``TORCHELASTIC_USE_AGENT_STORE=True`` on torch ≤ 2.11
turns every rank of the child's own groups into a client of a store nobody hosts, and ``env://`` or
a launcher inside the child reads the trainer's rank and master address as its own.

Left in place on purpose: ``OMP_NUM_THREADS`` and ``TORCH_NCCL_*``. torchrun sets them only as
defaults for a variable the user may have set (``TORCH_NCCL_ASYNC_ERROR_HANDLING`` keeps the user's
value), so from the environment alone the two cannot be told apart, and both are tuning, not identity.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

LAUNCHER_VARIABLES = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
})
"""The per-worker variables torchrun's local elastic agent sets (besides the ``TORCHELASTIC_`` ones)."""
LAUNCHER_PREFIXES = ("TORCHELASTIC_",)
"""torchrun's own variables: agent store, run id, restarts, error and timer files, health-check port."""


def is_launcher_variable(name: str) -> bool:
    return name in LAUNCHER_VARIABLES or name.startswith(LAUNCHER_PREFIXES)


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``base`` (default: this process's environment) without the launcher's variables:
    the environment every process the trainer starts gets."""
    base = os.environ if base is None else base
    return {k: v for k, v in base.items() if not is_launcher_variable(k)}
