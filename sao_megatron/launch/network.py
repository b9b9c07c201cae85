"""Which network interface a launched node uses for gloo and NCCL, and the environment that says so.

On a real cluster the first thing to break across hosts is the choice of interface: gloo
binds to whatever the node's hostname resolves to (``127.0.1.1`` on many images) unless
``GLOO_SOCKET_IFNAME`` names one, and NCCL's bootstrap picks the first non-loopback
interface it likes (often a docker or management bridge) unless ``NCCL_SOCKET_IFNAME`` does.
The node runners therefore always set both, on every node, from ``--iface``:

- ``auto`` (default): the interface that carries this node's own address (Slurm's
  ``NodeAddr``, resolved on the node), i.e. the network the other nodes reach it on;
- a name (``eth0``, ``ib0``, ``bond0``): that interface, which must exist on every node.

A node address that resolves to loopback while the other nodes' do not is an error: the
other nodes could never reach anything listening there.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

import psutil

log = logging.getLogger(__name__)
AUTO = "auto"
# Variables that steer the socket interface of each communication library a job uses.
IFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def resolve_ipv4(host: str) -> str:
    """The IPv4 address ``host`` (a name or an address) resolves to on this node."""
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(f"node address {host!r} does not resolve on {socket.gethostname()}: fix the "
                         f"cluster's name resolution or Slurm's NodeAddr") from exc


def interface_addresses() -> dict[str, list[str]]:
    """IPv4 addresses of each interface of this node: ``{"eth0": ["10.0.0.5"], "lo": ["127.0.0.1"]}``."""
    return {name: [a.address for a in addrs if a.family == socket.AF_INET]
            for name, addrs in psutil.net_if_addrs().items()}


def select_iface(requested: str, own_addr: str, interfaces: dict[str, list[str]] | None = None) -> str:
    """The interface for gloo/NCCL: ``requested`` checked to exist, or the one holding ``own_addr``.

    ValueError naming the available interfaces when there is no such interface.
    """
    interfaces = interface_addresses() if interfaces is None else interfaces
    listing = ", ".join(f"{n} ({' '.join(a) or 'no IPv4'})" for n, a in sorted(interfaces.items()))
    if requested != AUTO:
        if requested not in interfaces:
            raise ValueError(f"--iface {requested!r} does not exist on {socket.gethostname()}: choose one of "
                             f"{listing}")
        return requested
    ip = resolve_ipv4(own_addr)
    for name, addrs in sorted(interfaces.items()):
        if ip in addrs:
            return name
    raise ValueError(f"no interface of {socket.gethostname()} has its node address {own_addr} ({ip}): pass "
                     f"--iface with one of {listing}")


def check_reachable(addrs: list[str]) -> None:
    """ValueError when some node addresses resolve to loopback and others do not.

    That is the classic misconfiguration (a node's own name mapped to 127.0.1.1 in its
    /etc/hosts): whatever listens there is unreachable from the other nodes. All-loopback
    addresses are a single-host cluster (tests, the loopback fallback) and pass.
    """
    resolved = {a: resolve_ipv4(a) for a in addrs}
    looped = sorted(a for a, ip in resolved.items() if ipaddress.ip_address(ip).is_loopback)
    if looped and len(looped) < len(resolved):
        raise ValueError(f"node addresses {looped} resolve to loopback on {socket.gethostname()} while the others "
                         f"do not: the other nodes cannot reach them; set Slurm's NodeAddr (or /etc/hosts) to "
                         f"each node's own address")


def iface_env(iface: str) -> dict[str, str]:
    """Environment for every process a node runner starts (torchrun and its ranks, engines)."""
    return {name: iface for name in IFACE_VARIABLES}
