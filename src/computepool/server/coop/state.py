"""What the coop controller keeps of a cooperative service between passes, in its plan row.

The row's JSON holds the public plan (shaped as `CoopPlanOut`, what `explain` shows) and, under
`state`, the controller's own bookkeeping: the spec it last wrote (any other spec is the user's, and
re-plans), the allocations it started, and nodes it will not use again for this service. Keeping it
in the database rather than in memory lets a new leader carry on where the last one stopped.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from computepool.server.coop.measure import identity
from computepool.store.coop import CoopAlloc, Measurement, NodeRow, PlanRow
from computepool.wire.coop import CoopPlanOut, CoopSpec


@dataclass(frozen=True)
class SpeedCheck:
    service_id: int
    attempt: int
    endpoint: str
    key: str | None = field(repr=False)
    tokens: int


@dataclass
class Pass:
    """What one pass did, for the hub and the log (and what to measure after it)."""

    now: datetime
    ready: set[str]  # new work may go there: schedulable, heard from lately
    nodes: dict[str, NodeRow]
    alive: set[str] = field(default_factory=set)  # not lost (a late heartbeat is no reason to re-plan)
    checks: list[SpeedCheck] = field(default_factory=list)
    ended_nodes: set[str] = field(default_factory=set)
    ended: list[int] = field(default_factory=list)
    started: list[int] = field(default_factory=list)
    services: list[int] = field(default_factory=list)


def waited(now: datetime, a: CoopAlloc) -> float:
    """Seconds since the controller asked for this allocation."""
    return (now - a.created_at).total_seconds()


def canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def model_key(coop: CoopSpec, tenant_id: int) -> str:
    """The key the model's measurements are kept under: the user's, or one from the file's path —
    always within the tenant's own keys, so that another tenant's probes (of another file at the same
    path, or under a key chosen to match) never decide where this tenant's model runs."""
    if coop.model_key:
        base = coop.model_key
    else:
        stem = coop.model.rsplit("/", 1)[-1][:80] or "model"
        safe = "".join(c if c.isalnum() or c in "_.-" else "_" for c in stem)
        base = f"{safe}:{hashlib.sha256(coop.model.encode()).hexdigest()[:16]}"
    key = f"t{tenant_id}/{base}"
    return key if len(key) <= 128 else f"t{tenant_id}/{hashlib.sha256(base.encode()).hexdigest()}"


@dataclass
class RpcShard:
    alloc: int
    node: str
    endpoint: str  # ADDRESS:PORT the head connects to
    ready: bool = False


@dataclass
class State:
    written: str | None = None  # canon of the spec the controller last wrote
    probes: dict[str, int] = field(default_factory=dict)  # node → probe allocation
    unusable: dict[str, str] = field(default_factory=dict)  # node → why (its probe failed)
    excluded: dict[str, str] = field(default_factory=dict)  # node → why (lost while serving)
    rpc: list[RpcShard] = field(default_factory=list)
    head: str | None = None
    head_generation: int | None = None  # the generation whose replica is the head
    head_written_at: str | None = None  # ISO time: replica failures after it re-plan
    single_only: str | None = None  # why splits are off (one measured slower than a single device)
    speed_checked: bool = False
    split: bool = False
    best_single_tps: float | None = None
    plan_reason: str = ""  # why the planner chose this plan (the row's reason shows progress too)
    # the plan's secret: its RPC servers and head authenticate each other with it (a new plan, a
    # new secret); kept here, never in the public part
    secret: str | None = field(default=None, repr=False)
    failures: int = 0  # plans in a row that failed or were re-planned before running: back-off, give up
    excluded_at: dict[str, str] = field(default_factory=dict)  # node → ISO time it was excluded
    ready_since: dict[str, str] = field(default_factory=dict)  # excluded node → ISO time seen ready
    # node → when the measurement found to differ from the others' model file was taken (re-probed)
    reprobed: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, row: PlanRow | None) -> State:
        raw = dict((row.plan if row else {}).get("state") or {})
        rpc = [RpcShard(**r) for r in raw.pop("rpc", [])]
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(rpc=rpc, **known)

    def dump(self) -> dict[str, Any]:
        return asdict(self)


def expire_exclusions(st: State, ready: set[str], now: datetime, after_s: float) -> None:
    """A node excluded for a loss or a failed RPC server may be used again by the next plan once it
    has been ready for `after_s` (and excluded that long): a reboot or a network blip is not forever."""
    for n in list(st.excluded):
        if n not in ready:
            st.ready_since.pop(n, None)
            continue
        since = datetime.fromisoformat(st.ready_since.setdefault(n, now.isoformat()))
        at = datetime.fromisoformat(st.excluded_at[n]) if n in st.excluded_at else since
        if (now - max(since, at)).total_seconds() >= after_s:
            st.excluded.pop(n)
            st.excluded_at.pop(n, None)
            st.ready_since.pop(n)


def same_file(known: dict[str, Measurement], st: State) -> dict[str, Measurement]:
    """The measurements of one model file: a node whose file differs from the one measured last is
    probed again (its file changed since, or the other's did); still differing after that, it is
    unusable for this plan."""
    if not known:
        return known
    latest = identity(max(known.values(), key=lambda m: (m.measured_at, m.node)).detail)
    same = {}
    for n, m in known.items():
        if identity(m.detail) == latest:
            same[n] = m
        elif st.reprobed.setdefault(n, m.measured_at.isoformat()) != m.measured_at.isoformat():
            st.unusable[n] = "its model file differs from the other nodes' (size or digest)"
    return same


def public(row: PlanRow | None) -> dict[str, Any]:
    """The stored public part of the plan (what CoopPlanOut shows), empty before the first plan."""
    return dict((row.plan if row else {}).get("public") or {})


def empty_public() -> dict[str, Any]:
    return {
        "shards": [],
        "predicted_tokens_per_s": None,
        "measured_tokens_per_s": None,
        "best_single": None,
        "candidates": [],
        "links": [],
        "options": [],
    }


def plan_out(service: str, row: PlanRow | None, now: datetime) -> CoopPlanOut:
    body = empty_public() | public(row)
    return CoopPlanOut.model_validate(
        {
            **body,
            "service": service,
            "status": row.status if row else "measuring",
            "reason": row.reason if row else "waiting for the coop controller's first pass",
            "attempt": row.attempt if row else 0,
            "updated_at": row.updated_at if row else now,
        }
    )
