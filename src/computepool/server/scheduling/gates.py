"""Pending work that may not be placed yet, whatever the pool has free (no I/O, from the snapshot).

A job waits for the allocations it names in `after` to end the way it asks (ok: released; failed:
failed or preempted; any: any end), and ends unstarted when one ended otherwise; a job array keeps
no more than its limit of members bound or running; a job that failed and runs again waits for
its back-off (`retry_at`). The rules are logic/job_control.py's, kept in the request.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from computepool.server.scheduling.snapshot import Live, Snapshot

MEETS = {"ok": ("released",), "failed": ("failed", "preempted"), "any": None}


@dataclass
class Gate:
    held: dict[int, str] = field(default_factory=dict)  # pending id → why it may not start yet
    ends: dict[int, tuple[int, str]] = field(
        default_factory=dict
    )  # pending id → (attempt, why it never will)
    recheck_s: float | None = None  # the soonest back-off ends in this many seconds


def _after(a: Live, snap: Snapshot, live: dict[int, Live]) -> tuple[str | None, bool]:
    """Why `a` waits for its dependencies (None: it does not), and whether it never can start."""
    for dep in a.request.get("after") or []:
        i, on = int(dep["id"]), str(dep.get("on") or "ok")
        if i in live:
            return f"waits for {i} to end {on} (now {live[i].state})", False
        state = snap.ended.get(i)
        if state is None:
            return f"waits for {i} to end {on} (state not known yet)", False
        wanted = MEETS.get(on)
        if wanted is not None and state not in wanted:
            return f"dependency never met: {i} ended {state}, {on} was needed", True
    return None, False


HELD_PREFIXES = ("waits for ", "array ", "retry ")


def held_reason(reason: str) -> bool:
    """Whether a pending allocation's stored reason is one of these holds (what `explain` says)."""
    return reason.startswith(HELD_PREFIXES)


def judge(snap: Snapshot) -> Gate:
    """Which pending allocations are held back this cycle and why, and which end unstarted."""
    gate = Gate()
    live = {a.id: a for a in snap.live}
    running: Counter[int] = Counter()
    for a in snap.live:
        array = a.request.get("array")
        if array and a.state != "pending":
            running[int(array["id"])] += 1
    for a in snap.live:  # in id order: an array's members start in index order
        if a.state != "pending":
            continue
        why, never = _after(a, snap, live)
        if never:
            gate.ends[a.id] = (a.attempt, str(why))
            continue
        if why is None:
            why = _backoff(a.request, snap.now, gate)
        if why is None:
            why = _throttle(a.request, running)
        if why is not None:
            gate.held[a.id] = why
    return gate


def _backoff(req: dict[str, Any], now: datetime | None, gate: Gate) -> str | None:
    at_text = req.get("retry_at")
    if not at_text or now is None:
        return None
    at = datetime.fromisoformat(str(at_text))
    if at.tzinfo is None and now.tzinfo is not None:
        at = at.replace(tzinfo=now.tzinfo)
    left = (at - now).total_seconds()
    if left <= 0:
        return None
    gate.recheck_s = left if gate.recheck_s is None else min(gate.recheck_s, left)
    return f"retry {req.get('retried')} of {req.get('retries')}: back-off until {at:%H:%M:%S}"


def _throttle(req: dict[str, Any], running: Counter[int]) -> str | None:
    """A member past its array's limit waits; one let through counts as running from here on (it
    may bind this cycle)."""
    array = req.get("array")
    if not array or array.get("limit") is None:
        return None
    head, limit = int(array["id"]), int(array["limit"])
    if running[head] >= limit:
        return f"array {head}: {running[head]} of its members run (limit %{limit})"
    running[head] += 1
    return None
