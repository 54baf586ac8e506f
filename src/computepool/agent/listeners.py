"""Who listens on a service replica's port: the replica's own job, another process, or nobody.

Process jobs share the node's network, so another tenant's job can bind a replica's port before
the engine does (a large model takes minutes to load) and answer its health checks. Only the node
can tell who holds a socket, so the agent looks: the LISTEN sockets on the port in /proc/net/tcp
and /proc/net/tcp6 (their inodes and bound addresses), and whether those inodes are among the
descriptors (`socket:[INODE]` in /proc/PID/fd) of the job's own processes (its cgroup, else its
process tree: `Executor.job_pids`). It reports "own", "other" or "none" with the job's state; the
control plane marks a replica ready only on "own".

What counts is who would take a connection to the replica's endpoint (the node's address, which
the gateways and health checks dial), decided as the kernel does: a socket bound to that very
address first, then the wildcard of its family (0.0.0.0 before a dual-stack ::), then ::. Several
processes may listen on one port at once in different families or on different addresses (an
IPv6-only `[::]:P` beside the engine's `0.0.0.0:P`): such a listener takes none of the endpoint's
connections and changes nothing. Without a known node address the replica's own listener on the
port, on any address, is enough.

A container replica's engine listens in the container's own network namespace: on the node the
port is podman's (its conmon may hold it open, or the firewall forwards it), so there a listener
of podman's for that container counts as the job's, and no listener at all as its own too (the
port is published to the container); another process taking the endpoint's connections is
still "other".

The scan runs on its own thread, once per pass for every replica of the node (every 2 s, every
0.5 s while one is not yet its own listener; a report only on a change): /proc/net once,
then only the descriptors of the replicas' processes; the whole /proc is read only to name an
intruder in the agent's log (never to the tenant).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from computepool.agent.sockets import socket_fds

log = logging.getLogger("computepool.agent")

LISTEN = "0A"  # the kernel's TCP_LISTEN in /proc/net/tcp's `st` column
OWN, OTHER, NONE = "own", "other", "none"
SCAN_EVERY_S = 2.0
SCAN_STARTING_S = 0.5  # while a replica's own process does not listen yet: its readiness waits on this


IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def _address(hexed: str) -> IP:
    """An address of /proc/net/tcp{,6}: 32-bit words in the kernel's byte order, as hex."""
    raw = bytes.fromhex(hexed)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw)


def listening(proc: Path = Path("/proc")) -> dict[int, dict[int, IP]]:
    """Port → {inode: bound address} of the LISTEN sockets on it (IPv4 and IPv6) in the reader's
    network namespace."""
    out: dict[int, dict[int, IP]] = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / name).read_text().splitlines()[1:]
        except OSError:  # no IPv6 on this node
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != LISTEN:
                continue
            with contextlib.suppress(ValueError):
                addr, port = f[1].rsplit(":", 1)
                inode = int(f[9])
                if inode:
                    out.setdefault(int(port, 16), {})[inode] = _address(addr)
    return out


def node_ip(address: str | None) -> IP | None:
    """The node's address as an IP (an IPv4-mapped IPv6 one as IPv4); None for a name or nothing."""
    try:
        ip = ipaddress.ip_address((address or "").strip("[]").split("%")[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def reaching(on_port: dict[int, IP], address: IP) -> set[int]:
    """The inodes of the sockets that take a connection to `address` on their port, as the
    kernel picks: bound to that address, else the wildcard of its family, else a dual-stack ::."""
    v4 = isinstance(address, ipaddress.IPv4Address)
    exact = {i for i, a in on_port.items() if a == address}
    if v4:
        mapped = ipaddress.IPv6Address(f"::ffff:{address}")
        exact |= {i for i, a in on_port.items() if a == mapped}
    tiers = [exact]
    if v4:
        tiers.append({i for i, a in on_port.items() if a == ipaddress.IPv4Address(0)})
    tiers.append({i for i, a in on_port.items() if a == ipaddress.IPv6Address(0)})
    return next((t for t in tiers if t), set())


def socket_inodes(pid: int, proc: Path = Path("/proc")) -> set[int]:
    """Inodes of the sockets process `pid` holds (empty if it is gone or not ours to read)."""
    return set(socket_fds(pid, proc))


def holders(inodes: set[int], proc: Path = Path("/proc")) -> dict[int, int]:
    """Inode → a pid holding it, over every process this agent may read (for its log only)."""
    out: dict[int, int] = {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        for inode in socket_inodes(int(entry), proc) & inodes:
            out.setdefault(inode, int(entry))
        if len(out) == len(inodes):
            break
    return out


def cmdline(pid: int, proc: Path = Path("/proc")) -> str:
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


@dataclass(frozen=True)
class Replica:
    """One running replica to look at: its job key, port, processes, container (if any) and the
    node address its endpoint dials (None: not known)."""

    key: str
    port: int
    pids: frozenset[int]
    container: str | None = None
    address: str | None = None


def classify(
    r: Replica, sockets: dict[int, dict[int, IP]], proc: Path = Path("/proc")
) -> tuple[str, set[int]]:
    """ "own", "other" or "none" for one replica, and the inodes of the other processes' sockets
    that would take its endpoint's connections."""
    on_port = sockets.get(r.port, {})
    if not on_port:
        return (OWN if r.container else NONE), set()
    own: set[int] = set()
    for pid in r.pids:
        own |= socket_inodes(pid, proc)
    own &= set(on_port)
    ip = node_ip(r.address)
    # where the endpoint dials is not known: the replica's own listener, on any address, is enough
    reach = reaching(on_port, ip) if ip is not None else (own or set(on_port))
    foreign = reach - own
    if foreign and r.container:  # podman's conmon holding the published port of this very container
        for inode, pid in holders(foreign, proc).items():
            if r.container in cmdline(pid, proc).split():
                foreign.discard(inode)
    if foreign:
        return OTHER, foreign
    if reach:
        return OWN, set()
    return (OWN if r.container else NONE), set()  # nothing takes the endpoint's connections


class ListenerWatch:
    """Scans the node's replicas every `every_s` on its own thread; `found()` is the latest result
    (job key → "own"/"other"/"none") and `on_change` is called when it changed."""

    def __init__(
        self,
        replicas: Callable[[], Iterable[Replica]],
        on_change: Callable[[], None],
        every_s: float = SCAN_EVERY_S,
        proc: Path = Path("/proc"),
    ) -> None:
        self.replicas, self.on_change, self.every_s, self.proc = replicas, on_change, every_s, proc
        self._found: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def found(self) -> dict[str, str]:
        with self._lock:
            return dict(self._found)

    def scan(self) -> dict[str, str]:
        """One pass over every replica of the node; logs an intruder the first time it is seen."""
        reps = list(self.replicas())
        sockets = listening(self.proc) if reps else {}
        found: dict[str, str] = {}
        for r in reps:
            status, foreign = classify(r, sockets, self.proc)
            found[r.key] = status
            with self._lock:
                before = self._found.get(r.key)
            if status == OTHER and before != OTHER:
                who = ", ".join(
                    f"pid {pid} ({cmdline(pid, self.proc)[:120] or '?'})"
                    for pid in sorted(set(holders(foreign, self.proc).values()))
                )
                log.warning(
                    "%s: port %d is held by another process, not by the replica: %s",
                    r.key, r.port, who or "a process this agent cannot see",
                )  # fmt: skip
        with self._lock:
            changed = found != self._found
            self._found = found
        if changed:
            self.on_change()
        return found

    def _run(self) -> None:
        wait = self.every_s
        while not self._stop.wait(wait):
            try:
                found = self.scan()
            except Exception:  # a scan must never take the agent down: log, try again next pass
                log.exception("scanning the replicas' ports failed")
                found = {}
            settled = all(v == OWN for v in found.values())
            wait = self.every_s if settled else min(self.every_s, SCAN_STARTING_S)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cpool-listeners", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
