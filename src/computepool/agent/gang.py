"""A gang member's side: the environment that makes several nodes one compute domain.

The control plane tells every member of a gang its rank, the gang's size, rank 0's address and the
master port reserved there for this attempt, and every member's address. The agent turns that into
the variables `torchrun` and `torch.distributed.init_process_group(init_method="env://")` read, so
either runs unchanged as the gang's command:

    torchrun --nnodes $NNODES --node-rank $NODE_RANK --nproc-per-node $NPROC_PER_NODE \\
             --master-addr $MASTER_ADDR --master-port $MASTER_PORT train.py

RANK and WORLD_SIZE count one process per node slot (NODE_RANK × NPROC_PER_NODE): right for one
process per node, and overwritten by torchrun for the processes it starts.
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


class MasterPortBusy(OSError):
    """Rank 0 cannot offer the master port the control plane reserved: the member fails with it."""


@dataclass(frozen=True)
class Gang:
    """One member's view of its gang (the `gang` of an assignment)."""

    rank: int
    size: int
    master_addr: str
    master_port: int
    peers: tuple[str, ...]
    nproc_per_node: int = 1

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
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "size": self.size,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "peers": list(self.peers),
            "nproc_per_node": self.nproc_per_node,
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

    def check_master_port(self) -> None:
        """On rank 0: the reserved port must be free to listen on, else the member cannot start (the
        control plane then fails the gang with this reason, or picks a new port for a requeue)."""
        if self.rank != 0:
            return
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the rendezvous server will
            try:
                s.bind(("", self.master_port))
            except OSError as e:
                why = "in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
                raise MasterPortBusy(
                    f"master port {self.master_port} on this node (rank 0 of the gang) is {why}"
                ) from None
