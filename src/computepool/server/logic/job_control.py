"""Job arrays, dependencies and retries at admission and at a job's end (the scheduler's side,
which holds members back, is in scheduling/gates.py).

All of it lives in the allocation's stored request: `array` ({id, index, count, limit}; the array's
id is its first member's id), `after` ([{id, on}]), `retries`, `retry_on_exit`, and, once the job
failed and runs again, `retried` and `retry_at` (when its back-off ends).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from computepool.server.errors import Invalid, not_found
from computepool.store import allocations as store
from computepool.store.models import Allocation
from computepool.wire.allocations import AllocationCreate, parse_array

MAX_BACKOFF_S = 60


def stored(body: AllocationCreate) -> dict[str, Any]:
    """The request's keys for what it waits for and how often it runs again (only those set)."""
    if body.command is None:
        for field in ("array", "retries", "retry_on_exit"):
            if getattr(body, field):
                raise Invalid(f"{field}: only a job (give command) runs as an array or again", field)
    if body.gang_nodes > 1 and (body.retries or body.retry_on_exit):
        raise Invalid("retries: a job over several nodes is not retried (use restartable)", "retries")
    if body.retry_on_exit and not body.retries:
        raise Invalid("retry_on_exit: given without retries", "retry_on_exit")
    out: dict[str, Any] = {}
    if body.after:
        out["after"] = [a.model_dump() for a in body.after]
    if body.retries:
        out["retries"] = body.retries
        out["retry_on_exit"] = sorted(set(body.retry_on_exit)) if body.retry_on_exit else None
    return out


def check_after(s: Session, tenant_id: int, req: dict[str, Any]) -> None:
    """Every allocation it waits for exists and is its tenant's; another's reads as a missing one."""
    for i, dep in enumerate(req.get("after") or []):
        owner = s.execute(select(Allocation.tenant_id).where(Allocation.id == dep["id"])).scalar()
        if owner != tenant_id:
            raise Invalid(f"after[{i}]: {not_found('allocation', dep['id'])}", f"after[{i}]")


def insert(s: Session, body: AllocationCreate, row: dict[str, Any], now: datetime) -> int:
    """Insert one pending allocation, or every member of a job array (then `row` becomes the first
    member's); returns the first one's id, which is the array's."""
    if body.array is None:
        return store.insert_pending(s, row, now)
    indices, limit = parse_array(body.array)
    head = 0
    for k, index in enumerate(indices):
        array = {"id": head, "index": index, "count": len(indices), "limit": limit}
        env = dict(row["env"] or {}, CPOOL_ARRAY_INDEX=str(index), CPOOL_ARRAY_COUNT=str(len(indices)))
        member = dict(row, request=dict(row["request"], array=array), env=env)
        if k == 0:
            head = store.insert_pending(s, member, now)
            member["request"]["array"]["id"] = head
            member["env"]["CPOOL_ARRAY_ID"] = str(head)
            member["request"]["env"] = member["env"]
            s.execute(
                update(Allocation)
                .where(Allocation.id == head)
                .values(request=member["request"], env=member["env"]),
                execution_options={"synchronize_session": False},
            )
            row.update(request=member["request"], env=member["env"])
        else:
            member["env"]["CPOOL_ARRAY_ID"] = str(head)
            member["request"]["env"] = member["env"]
            store.insert_pending(s, dict(member, idempotency_key=None), now)
    return head


def out_fields(req: dict[str, Any]) -> dict[str, Any]:
    """AllocationOut's top-level view of them (what `cpool ps --json` shows)."""
    array = req.get("array") or {}
    return {
        "array_id": array.get("id"),
        "array_index": array.get("index"),
        "after": req.get("after"),
        "retries": int(req.get("retries") or 0),
    }


def retry_delay(req: dict[str, Any], exit_code: int | None) -> int | None:
    """Seconds to wait before running a job again that ended with `exit_code` (None: a start that
    failed), or None when it is not run again."""
    retries, done = int(req.get("retries") or 0), int(req.get("retried") or 0)
    if done >= retries or exit_code is None or exit_code == 0:
        return None
    codes = req.get("retry_on_exit")
    if codes and exit_code not in codes:
        return None
    return int(min(MAX_BACKOFF_S, 2**done))


def retry(s: Session, a: Allocation, what: str, delay_s: int, now: datetime) -> None:
    """Run it again as the next attempt once `delay_s` has passed (scheduling/gates.py waits)."""
    done = int(a.request.get("retried") or 0) + 1
    at = now + timedelta(seconds=delay_s)
    a.request = dict(a.request, retried=done, retry_at=at.isoformat())
    why = f"{what}; retry {done} of {a.request['retries']} as attempt {a.attempt + 1} in {delay_s}s"
    store.requeue(s, a, why, now)
