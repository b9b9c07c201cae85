"""Ports (bottom floor: no package imports): the one place that asks the OS for a free TCP port,
and the per-job port blocks a Slurm job owns on its nodes, outside the kernel's ephemeral range."""

from __future__ import annotations

import logging
import socket

log = logging.getLogger(__name__)

PORT_RANGE_START = 20000  # above the well-known and registered services a cluster node usually runs
PORT_RANGE_END = 65536
PORTS_PER_JOB = 200
MASTER_PORT_OFFSET = PORTS_PER_JOB - 2
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LINUX_DEFAULT_EPHEMERAL = (32768, 60999)


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free on ``host`` right now (a racing process may still take it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_blocks(ephemeral: tuple[int, int]) -> list[int]:
    """First ports of the job blocks in ``[PORT_RANGE_START, PORT_RANGE_END)`` that do not meet the
    ephemeral range ``(low, high)`` (both inclusive, as the sysctl gives them), in ascending order."""
    low, high = ephemeral
    free = [(PORT_RANGE_START, min(low, PORT_RANGE_END)), (max(high + 1, PORT_RANGE_START), PORT_RANGE_END)]
    return [b for start, end in free for b in range(start, end - PORTS_PER_JOB + 1, PORTS_PER_JOB)]


def port_base(job_id: int, ephemeral: tuple[int, int]) -> int:
    """First port of the block a job owns (same block on every requeue of the job); ``ephemeral`` is the
    node's ``net.ipv4.ip_local_port_range``. ValueError when no block fits outside it."""
    blocks = port_blocks(ephemeral)
    if not blocks:
        low, high = ephemeral
        raise ValueError(
            f"no block of {PORTS_PER_JOB} ports in {PORT_RANGE_START}-{PORT_RANGE_END - 1} lies outside this node's "
            f"ephemeral port range {low}-{high} (net.ipv4.ip_local_port_range), where the kernel picks client "
            f"ports: narrow it on every node, e.g. `sysctl -w net.ipv4.ip_local_port_range=\"32768 60999\"`")
    return blocks[job_id % len(blocks)]


def ephemeral_port_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """This node's ephemeral port range ``(low, high)``, inclusive (per network namespace on Linux).

    Without the file (not Linux) Linux's default is assumed, with a warning; a file that does not
    hold two ports is a ValueError.
    """
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        log.warning("%s not found: assuming the ephemeral port range %d-%d", path, *LINUX_DEFAULT_EPHEMERAL)
        return LINUX_DEFAULT_EPHEMERAL
    fields = text.split()
    if len(fields) != 2 or not all(f.isdigit() for f in fields):
        raise ValueError(f"{path} should hold two port numbers, got {text.strip()!r}")
    low, high = int(fields[0]), int(fields[1])
    return (low, high) if low <= high else (high, low)
