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

from computepool.server.schemas.coop import CoopPlanOut, CoopSpec
from computepool.store.coop import PlanRow


def canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def model_key(coop: CoopSpec) -> str:
    """The key the model's measurements are kept under: the user's, or one from the file's path."""
    if coop.model_key:
        return coop.model_key
    stem = coop.model.rsplit("/", 1)[-1][:80] or "model"
    safe = "".join(c if c.isalnum() or c in "_.-" else "_" for c in stem)
    return f"{safe}:{hashlib.sha256(coop.model.encode()).hexdigest()[:16]}"


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

    @classmethod
    def of(cls, row: PlanRow | None) -> State:
        raw = dict((row.plan if row else {}).get("state") or {})
        rpc = [RpcShard(**r) for r in raw.pop("rpc", [])]
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(rpc=rpc, **known)

    def dump(self) -> dict[str, Any]:
        return asdict(self)


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
