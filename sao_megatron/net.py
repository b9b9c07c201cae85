"""Ports: the one place that asks the OS for a free TCP port (bottom floor: no package imports)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free on ``host`` right now (a racing process may still take it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
