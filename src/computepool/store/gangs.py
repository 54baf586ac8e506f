"""The SQL of gangs at run time: node addresses, the master ports held, a bound gang's members.

The decisions (which port, what a member's report means) live in `server.logic.gangs`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from computepool.core.allocation import HOLDING
from computepool.store.models import Allocation, AllocationNode, Node

_ALLOC = Allocation.__table__
_NODES = AllocationNode.__table__
_NODE_T = Node.__table__

_SET_GANG = (
    update(_ALLOC)
    .where(_ALLOC.c.id == bindparam("g_id"), _ALLOC.c.attempt == bindparam("g_attempt"))
    .values(master_port=bindparam("g_port"), members=bindparam("g_members"))
)
_SET_ADDRESS = (
    update(_NODE_T)
    .where(_NODE_T.c.name == bindparam("n_name"), _NODE_T.c.address != bindparam("n_address"))
    .values(address=bindparam("n_address"))
)


def addresses(s: Session, names: Collection[str]) -> dict[str, str]:
    """node name → its address ("" when it never said and was never seen)."""
    if not names:
        return {}
    stmt = select(_NODE_T.c.name, _NODE_T.c.address).where(_NODE_T.c.name.in_(list(names)))
    return {name: addr or "" for name, addr in s.connection().execute(stmt)}


def held_ports(s: Session, rank0_nodes: Collection[str]) -> dict[str, set[int]]:
    """node → the master ports of holding gang attempts whose rank 0 is that node."""
    out: dict[str, set[int]] = {n: set() for n in rank0_nodes}
    if not rank0_nodes:
        return out
    stmt = (
        select(_ALLOC.c.nodes, _ALLOC.c.master_port)
        .join(_NODES, _NODES.c.allocation_id == _ALLOC.c.id)
        .where(
            _NODES.c.node.in_(list(rank0_nodes)),
            _ALLOC.c.master_port.is_not(None),
            _ALLOC.c.state.in_(list(HOLDING)),
        )
    )
    for nodes, port in s.connection().execute(stmt):
        if nodes and nodes[0] in out:
            out[nodes[0]].add(int(port))
    return out


def set_gangs(s: Session, rows: list[dict[str, Any]]) -> None:
    """Write master port and members of freshly bound gangs: rows of g_id, g_attempt, g_port, g_members."""
    if rows:
        s.connection().execute(_SET_GANG, rows)


def set_address(s: Session, node: str, address: str) -> None:
    """Record where peers reach `node` (one UPDATE that changes nothing when it is already so)."""
    s.connection().execute(_SET_ADDRESS, {"n_name": node, "n_address": address})
