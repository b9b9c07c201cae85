"""The TCP sockets of a Slurm job's processes, read from /proc inside each node's network namespace.

``/proc/<pid>/net/tcp{,6}`` is the table of the namespace ``pid`` lives in, and
``/proc/<pid>/fd`` names the socket inodes the process holds: together they give every
process's listening and connected sockets on its own node, which ``ss`` run on the host
(or psutil, which reads the caller's table) cannot see.
"""

from __future__ import annotations

import ipaddress
import os
import re
import threading
from dataclasses import dataclass

import psutil

# /proc/net/tcp state codes (include/net/tcp_states.h) of the states that matter here.
_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "0A": "LISTEN"}
_STEPD = re.compile(r"^slurmstepd: \[(\d+)\.")


@dataclass(frozen=True, slots=True)
class Sock:
    """One TCP socket of one process: ``local``/``remote`` are (address, port)."""

    node: str
    pid: int
    cmd: str
    state: str
    local: tuple[str, int]
    remote: tuple[str, int]
    job: str = ""


def decode_address(text: str) -> tuple[str, int]:
    """``0100007F:1F90`` -> ("127.0.0.1", 8080); IPv6 is four little-endian 32-bit words."""
    addr_hex, port_hex = text.split(":")
    raw = bytes.fromhex(addr_hex)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return str(ip), int(port_hex, 16)


def parse_tcp_table(text: str) -> dict[int, tuple[str, tuple[str, int], tuple[str, int]]]:
    """inode -> (state, local, remote) for the rows of a /proc/net/tcp or tcp6 table in ``_STATES``."""
    rows = {}
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) > 9 and f[3] in _STATES:
            rows[int(f[9])] = (_STATES[f[3]], decode_address(f[1]), decode_address(f[2]))
    return rows


def socket_inodes(pid: int) -> set[int]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor, for one)
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def process_sockets(pid: int, node: str, job: str = "") -> list[Sock]:
    """Every TCP socket ``pid`` holds, from its own namespace's tables (empty once it is gone)."""
    try:
        inodes = socket_inodes(pid)
        table = {}
        for name in ("tcp", "tcp6"):
            with open(f"/proc/{pid}/net/{name}") as f:
                table.update(parse_tcp_table(f.read()))
        cmd = " ".join(psutil.Process(pid).cmdline())[:200]
    except (OSError, psutil.Error):
        return []
    return [Sock(node, pid, cmd, *table[i], job=job) for i in inodes if i in table]


def job_processes(job_id: str) -> dict[int, str]:
    """pid -> node name of every process of the job (all descendants of its slurmstepds)."""
    out = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        m = _STEPD.match(cmdline)
        if not m or m.group(1) != str(job_id):
            continue
        try:
            children = proc.children(recursive=True)
        except psutil.Error:
            continue
        for p in children:  # not the stepd itself: Slurm's own sockets are not the job's
            out[p.pid] = node_of(p.pid)
    return out


def node_of(pid: int) -> str:
    """The emulated node ``pid`` runs on: its network namespace's name, else SLURMD_NODENAME."""
    try:
        ino = os.stat(f"/proc/{pid}/ns/net").st_ino
        for name in os.listdir("/run/netns") if os.path.isdir("/run/netns") else []:
            if os.stat(f"/run/netns/{name}").st_ino == ino:
                return name.removeprefix("sao-")
        return psutil.Process(pid).environ().get("SLURMD_NODENAME", "?")
    except (OSError, psutil.Error):
        return "?"


class SocketMonitor:
    """Samples the job's sockets every ``interval_s`` in a thread; ``sockets`` is the union seen."""

    def __init__(self, job_ids: list[str], interval_s: float = 0.5):
        self.job_ids = job_ids
        self.interval_s = interval_s
        self.sockets: set[Sock] = set()
        self.environ: dict[tuple[str, str], dict[str, str]] = {}  # (node, cmd) -> its *_SOCKET_IFNAME variables
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="socket-monitor")

    def __enter__(self) -> SocketMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for job_id in self.job_ids:
                for pid, node in job_processes(job_id).items():
                    self.sockets.update(process_sockets(pid, node, job_id))
                    self._note_environ(pid, node)

    def _note_environ(self, pid: int, node: str) -> None:
        try:
            env = psutil.Process(pid).environ()
            cmd = " ".join(psutil.Process(pid).cmdline())[:200]
        except psutil.Error:
            return
        self.environ.setdefault((node, cmd), {k: v for k, v in env.items() if k.endswith("_SOCKET_IFNAME")})


def loopback_uses(sockets: set[Sock]) -> list[Sock]:
    """Sockets that listen on or talk over loopback (127.0.0.0/8, ::1)."""
    def looped(addr: str) -> bool:
        return ipaddress.ip_address(addr).is_loopback

    return sorted((s for s in sockets if looped(s.local[0]) or (s.state != "LISTEN" and looped(s.remote[0]))),
                  key=lambda s: (s.node, s.pid, s.local))
