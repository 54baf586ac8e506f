"""Gangs at run time: many nodes as one compute domain.

A gang's members are the nodes of its allocation in order: rank r is `nodes[r]`, rank 0 hosts
the rendezvous (`MASTER_ADDR:MASTER_PORT`). When a gang is bound, each attempt gets a master port
from a configured range that no other holding gang with the same rank-0 node holds, and a member
record per node. Rank 0 starts first: should another process hold the reserved port on its
node, its agent takes a free one (of the range, else any) and says so when it reports running;
the other members are given their assignment only then, with the port rank 0 offers. The agents'
reports then move members, and the gang as a whole:

- it turns active when its first member runs, and is released only once every member exited 0;
- a member that exits non-zero or fails ends the gang (failed, naming rank and node); the other
  members stop because the allocation no longer holds (their assignment goes, their next report
  is answered stale);
- a lost member requeues a restartable gang as a whole (attempt + 1, every member again, a fresh
  master port); otherwise it fails the gang, naming the member.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from computepool.server.logic.report_times import reported_start
from computepool.store import allocations as store
from computepool.store.agent_rows import HeldJob
from computepool.store.models import Allocation
from computepool.wire.allocation_out import GangOut, MemberOut, Report

log = logging.getLogger("computepool.server")

ACTIVE_MEMBER = ("starting", "running")  # shown as `stopped` once the gang has ended


def is_gang(a: Any) -> bool:
    """A bound gang over several nodes (member records kept), as opposed to a one-node allocation."""
    return bool(a.members) and len(a.nodes) > 1


def gang_of(a: Allocation | HeldJob, node: str, ports: tuple[int, int] | None = None) -> GangOut | None:
    """What `node`'s member of gang `a` is told: its rank, the size, the rendezvous, its peers, and
    (`ports`, the gang port range) where rank 0 may take another master port."""
    if not is_gang(a) or a.master_port is None:
        return None
    members = list(a.members or [])
    rank = next((int(m["rank"]) for m in members if m["node"] == node), None)
    if rank is None:
        return None
    peers = [str(m.get("address") or m["node"]) for m in members]
    return GangOut(
        rank=rank,
        size=len(members),
        master_addr=peers[0],
        master_port=int(a.master_port),
        peers=peers,
        nproc_per_node=max(1, int(a.request.get("gpus") or 0)),
        master_ports=list(ports) if ports is not None and rank == 0 else None,
    )


def awaits_rank0(a: Allocation | HeldJob, node: str) -> bool:
    """Whether `node`'s member of gang `a` must wait: it is not rank 0, and rank 0 has not yet said
    it runs (with the master port it offers, which may not be the reserved one). No member ever
    dials a port that a stranger holds on rank 0's node."""
    if not is_gang(a):
        return False
    members = list(a.members or [])
    return bool(members) and members[0]["node"] != node and members[0].get("state") == "starting"


def members_out(a: Any) -> list[MemberOut]:
    """The members of a gang for AllocationOut (empty for one node); once the gang has ended, the
    members it stopped show as `stopped`."""
    if not a.members:
        return []
    ended = a.state not in store.HOLDING
    out = []
    for m in a.members:
        state = m.get("state") or "starting"
        if ended and state in ACTIVE_MEMBER:
            state = "stopped"
        out.append(
            MemberOut(
                rank=int(m["rank"]),
                node=str(m["node"]),
                address=str(m.get("address") or ""),
                state=state,  # type: ignore[arg-type]  # one of MemberState, as written here
                exit_code=m.get("exit_code"),
                reason=str(m.get("reason") or ""),
            )
        )
    return out


def apply_report(s: Session, a: Allocation, node: str, r: Report, now: datetime) -> None:
    """One member's report about gang `a` (holding, current attempt); moves the gang as it follows."""
    members = [dict(m) for m in a.members or []]
    me = next((m for m in members if m["node"] == node), None)
    if me is None:
        return
    who = f"rank {me['rank']} on node {node}"
    if r.state == "running":
        if me["state"] == "starting":
            me["state"] = "running"
            if int(me["rank"]) == 0 and r.master_port is not None and r.master_port != a.master_port:
                log.info(
                    "allocation %d: master port %s was held on %s; rank 0 offers %d", a.id, a.master_port,
                    node, r.master_port,
                )  # fmt: skip
                a.master_port = r.master_port  # the others are told this one (awaits_rank0)
        a.members = members
        if a.state == "bound":
            a.started_at = reported_start(a, r.started_at, now)
            store.transition(s, a, "active", f"started on {node} (rank {me['rank']})", now)
        return
    if r.state == "exited" and r.exit_code == 0:
        me.update(state="exited", exit_code=0, reason="")
        a.members = members
        if all(m["state"] == "exited" and m.get("exit_code") == 0 for m in members):
            a.exit_code = 0
            store.transition(s, a, "released", f"exited 0 on all {len(members)} nodes", now)
        elif a.state == "bound":
            store.transition(s, a, "active", f"started on {node} (rank {me['rank']})", now)
        return
    if r.state in ("exited", "failed"):
        what = f"exited {r.exit_code}" if r.state == "exited" else "failed"
        detail = f": {r.reason}" if r.reason and r.state == "failed" else ""
        me.update(state=r.state, exit_code=r.exit_code, reason=(r.reason or what)[:1000])
        why = f"{who} {what}{detail}"
        _stop_others(members, me, why)
        a.members = members
        a.exit_code = r.exit_code
        store.transition(s, a, "failed", why, now)
        return
    lost = f"{who}: process lost" + (f" ({r.reason})" if r.reason else "")
    if a.restartable:
        store.requeue(s, a, f"{lost}; the gang is requeued as attempt {a.attempt + 1}", now)
        return
    me.update(state="lost", reason=(r.reason or "process lost")[:1000])
    _stop_others(members, me, lost)
    a.members = members
    store.transition(s, a, "failed", lost, now)


def _stop_others(members: list[dict[str, Any]], me: dict[str, Any], why: str) -> None:
    for m in members:
        if m is not me and m["state"] in ACTIVE_MEMBER:
            m.update(state="stopped", reason=f"stopped: {why}"[:1000])
