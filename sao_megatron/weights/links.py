"""What a distributed push knows of its world: the trainer's ranks (:class:`_World`), each engine as one
sender sees it (:class:`EngineLink`), a sender's tally (:class:`_SenderStats`), and where the engines
can dial this host (:func:`address_towards`)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from sao_megatron.parallel.collectives import broadcast_object
from sao_megatron.rollout.weight_check import EngineHolding


class EngineSyncFailed(RuntimeError):
    """One engine failed during a sync (dead, timed out, or refused); the others continue."""


@dataclass
class EngineLink:
    """One engine as seen by one sender: its URL, size and this sender's group with it."""

    index: int
    url: str
    tp_size: int
    holding: EngineHolding = EngineHolding(None)
    """How the engine holds the weights it reports checksums of (from its /server_info)."""
    group_name: str = ""
    group: Any = None
    failed: str | None = None
    joins: int = 0
    """Groups built with this engine so far: each gets a new name (a broken group cannot be destroyed
    cleanly while its collective is pending, and torch refuses to reuse the name)."""


@dataclass
class _SenderStats:
    owned: int = 0
    """Bytes this sender owns (it sends them to each engine)."""
    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0
    failed: dict[str, str] = field(default_factory=dict)
    checksums: dict[EngineHolding, dict[str, str]] = field(default_factory=dict)
    """Per way of holding the weights (engines may differ): the checksums the engines must report."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds this sender spent per step of the push (``flatten``, ``wait_send``): the fixed costs."""


class _World:
    """Rank-0-centred object collectives over the trainer's group (a lone process without one)."""

    def __init__(self, group=None, *, alone: bool = False):
        self.group = group
        self.on = not alone and dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.on else 0
        self.size = dist.get_world_size(group) if self.on else 1

    @classmethod
    def alone(cls) -> _World:
        return cls(alone=True)

    def bcast(self, obj: Any) -> Any:
        return broadcast_object(obj, self.group) if self.on else obj

    def gather(self, obj: Any) -> list[Any]:
        if not self.on:
            return [obj]
        box: list[Any] = [None] * self.size
        dist.all_gather_object(box, obj, group=self.group)
        return box


def address_towards(host: str) -> str:
    """This host's address on the route to ``host`` (the engines): where they can dial our group's
    TCP store. A hostname that resolves to loopback (Debian's 127.0.1.1) or to another interface than
    the one that reaches the engines is the classic multi-node failure; routing cannot be wrong. A UDP
    connect sends nothing, it only asks the kernel for the route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]
