"""The embedded engine's listening socket: replies must not wait for the client's delayed ACK."""

from __future__ import annotations

import asyncio
import socket

import pytest

from sao_megatron.rollout.engine.cli import listen_socket

pytestmark = pytest.mark.unit


async def _accepted_nodelay(sock: socket.socket) -> int:
    """TCP_NODELAY of a connection accepted the way uvicorn accepts it (``loop.create_server(sock=...)``)."""
    seen: asyncio.Future = asyncio.get_running_loop().create_future()

    class Probe(asyncio.Protocol):
        def connection_made(self, transport):
            seen.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
    try:
        host, port = sock.getsockname()[:2]
        _, writer = await asyncio.open_connection(host, port)
        writer.close()
        return await asyncio.wait_for(seen, 10)
    finally:
        server.close()


def test_accepted_connections_disable_nagle():
    """With Nagle on, a keep-alive reply written in two parts (headers, body) waits ~40 ms for the
    client's delayed ACK: every weight-update call and /generate paid it (0.04 s per call)."""
    assert asyncio.run(_accepted_nodelay(listen_socket("127.0.0.1", 0))) != 0


def test_reference_a_protocol_less_socket_keeps_nagle():
    """The reference the fix relies on: asyncio leaves Nagle on for a socket created without its protocol."""
    sock = socket.socket(socket.AF_INET)
    sock.bind(("127.0.0.1", 0))
    assert asyncio.run(_accepted_nodelay(sock)) == 0
