"""A gang member's side: the environment that makes several nodes one compute domain.

The control plane tells every member of a gang its rank, the gang's size, rank 0's address and the
master port reserved there for this attempt, and every member's address. The agent turns that into
the variables `torchrun` and `torch.distributed.init_process_group(init_method="env://")` read, so
either runs unchanged as the gang's command:

    torchrun --nnodes $NNODES --node-rank $NODE_RANK --nproc-per-node $NPROC_PER_NODE \\
             --master-addr $MASTER_ADDR --master-port $MASTER_PORT train.py

RANK and WORLD_SIZE count one process per node slot (NODE_RANK × NPROC_PER_NODE): right for one
process per node, and overwritten by torchrun for the processes it starts.

Rank 0 starts first and offers the master port: the reserved one, or another free one when a
process on its node holds it (`offer_port`); the agent reports the port it offered, and the
control plane tells the other members that one before they start.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def interface_of(address: str) -> str | None:
    """The name of the local interface holding `address` (an IP), or None when none does."""
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address.split("%")[0] == address for a in addrs):
                return name
    except (OSError, RuntimeError):
        return None
    return None


def _range(v: Any) -> tuple[int, int] | None:
    if not v or len(v) != 2:
        return None
    lo, hi = int(v[0]), int(v[1])
    return (lo, hi) if 0 < lo <= hi < 65536 else None


class MasterPortBusy(OSError):
    """Rank 0 finds no port to offer as the master port: the member fails with it."""


def port_free(port: int) -> bool:
    """Whether a listener could take `port` on every address of both families now, as the
    rendezvous server does (torch's TCPStore binds a dual-stack ::): a process holding it on any
    address or family, an IPv6-only `[::]:port` too, makes it taken. `port` 0: never."""
    if port <= 0:
        return False
    for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this node: IPv4 alone
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the rendezvous server will
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                s.bind((addr, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return False
                continue  # e.g. IPv6 off on this node: ask IPv4
            return True
    return False


def any_free_port() -> int:
    """A port the kernel finds free on every address of both families (0 when it finds none)."""
    for family, addr in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                s.bind((addr, 0))
                return int(s.getsockname()[1])
        except OSError:
            continue
    return 0


@dataclass(frozen=True)
class Gang:
    """One member's view of its gang (the `gang` of an assignment)."""

    rank: int
    size: int
    master_addr: str
    master_port: int
    peers: tuple[str, ...]
    nproc_per_node: int = 1
    master_ports: tuple[int, int] | None = None  # the gang range rank 0 takes another port from

    @classmethod
    def parse(cls, d: Mapping[str, Any] | None) -> Gang | None:
        if not d:
            return None
        return cls(
            rank=int(d["rank"]),
            size=int(d["size"]),
            master_addr=str(d["master_addr"]),
            master_port=int(d["master_port"]),
            peers=tuple(str(p) for p in d.get("peers") or ()),
            nproc_per_node=max(1, int(d.get("nproc_per_node") or 1)),
            master_ports=_range(d.get("master_ports")),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "size": self.size,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "peers": list(self.peers),
            "nproc_per_node": self.nproc_per_node,
            "master_ports": list(self.master_ports) if self.master_ports else None,
        }

    def env(self) -> dict[str, str]:
        """The variables every member's job gets (they win over the user's of the same name)."""
        nproc = self.nproc_per_node
        return {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "NNODES": str(self.size),
            "NODE_RANK": str(self.rank),
            "NPROC_PER_NODE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "WORLD_SIZE": str(self.size * nproc),
            "RANK": str(self.rank * nproc),
            "LOCAL_RANK": "0",
            "CPOOL_RANK": str(self.rank),
            "CPOOL_PEERS": ",".join(self.peers),
        }

    def interface_env(self, user_env: Mapping[str, str]) -> dict[str, str]:
        """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME naming the interface that holds this member's
        address, unless the user set them: gloo and NCCL otherwise advertise the address the host
        name resolves to, which on many hosts is a loopback one (Debian maps it to 127.0.1.1)."""
        own = self.peers[self.rank] if 0 <= self.rank < len(self.peers) else ""
        ifname = interface_of(own)
        if ifname is None:
            return {}
        return {k: ifname for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k not in user_env}

    def offer_port(self) -> int:
        """On rank 0: the master port to offer. The reserved one when it is free on this node; else,
        as another process holds it (any address, either family), the first free port of the gang
        range after it, else one the kernel finds free: a stranger on the port never fails the gang
        (the agent reports the port it took; the other members are told it before they start).
        Other ranks: the port they were told. Raises MasterPortBusy when no port is free."""
        if self.rank != 0 or port_free(self.master_port):
            return self.master_port
        lo, hi = self.master_ports or (self.master_port, self.master_port)
        size = hi - lo + 1
        start = self.master_port - lo + 1 if lo <= self.master_port <= hi else 0
        for i in range(size):
            port = lo + (start + i) % size
            if port != self.master_port and port_free(port):
                return port
        port = any_free_port()
        if not port:
            raise MasterPortBusy(
                f"master port {self.master_port} on this node (rank 0 of the gang) is in use, and no other "
                "port is free"
            )
        return port
