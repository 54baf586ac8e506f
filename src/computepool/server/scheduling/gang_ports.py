"""Gang master ports, given when the scheduler binds a gang (in its binding transaction).

Each attempt of a gang gets a master port from a configured range that no other holding gang with
the same rank-0 node holds, and a member record per node; `server.logic.gangs` moves members
and gangs from the agents' reports after that.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session

from computepool.store import gangs as sql

log = logging.getLogger("computepool.server")

DEFAULT_PORTS = (29500, 29999)


@dataclass(frozen=True)
class BoundGang:
    """A gang just bound by the scheduler: which attempt, on which nodes (rank order)."""

    id: int
    attempt: int
    nodes: Sequence[str]


def choose_port(alloc_id: int, attempt: int, held: set[int], ports: tuple[int, int]) -> int:
    """A port of `ports` (inclusive) not in `held`. The search starts at a place that depends on the
    allocation and attempt, so a requeued gang whose port was taken on its node tries another one."""
    lo, hi = ports
    size = hi - lo + 1
    start = int(hashlib.sha256(f"{alloc_id}:{attempt}".encode()).hexdigest()[:8], 16) % size
    for i in range(size):
        port = lo + (start + i) % size
        if port not in held:
            return port
    log.warning("every gang port %d-%d is held on one node; allocation %d shares one", lo, hi, alloc_id)
    return lo + start


def reserve(s: Session, gangs: Iterable[BoundGang], ports: tuple[int, int] = DEFAULT_PORTS) -> None:
    """Give freshly bound gangs (inside the binding transaction) a master port and member records."""
    todo = [g for g in gangs if len(g.nodes) > 1]
    if not todo:
        return
    addr = sql.addresses(s, {n for g in todo for n in g.nodes})
    held = sql.held_ports(s, {g.nodes[0] for g in todo})
    rows = []
    for g in todo:
        port = choose_port(g.id, g.attempt, held[g.nodes[0]], ports)
        held[g.nodes[0]].add(port)
        members = [
            {"rank": r, "node": n, "address": addr.get(n) or n, "state": "starting", "exit_code": None,
             "reason": ""}
            for r, n in enumerate(g.nodes)
        ]  # fmt: skip
        rows.append({"g_id": g.id, "g_attempt": g.attempt, "g_port": port, "g_members": members})
    sql.set_gangs(s, rows)
