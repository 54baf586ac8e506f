"""Times an agent reports, kept inside what the control plane itself saw.

An agent's clock may be skewed (minutes, after a bad NTP step or a thawed VM): a start it reports
is used only between the allocation's bind and the moment the report arrives, both on the
database's clock, so a start is never before the bind nor in the future, and what the ledger and
`ps` show follow the server's time for every state change.
"""

from __future__ import annotations

from datetime import UTC, datetime

from computepool.store.agent_rows import Reported
from computepool.store.models import Allocation


def reported_start(a: Allocation | Reported, reported: datetime | None, now: datetime) -> datetime:
    """When `a` started: the agent's time when it lies between the bind and `now`, else the
    nearer of the two; `now` when the agent gave none."""
    if reported is None:
        return now
    t = reported.replace(tzinfo=UTC) if reported.tzinfo is None else reported
    floor = a.bound_at or a.created_at
    return max(floor, min(t, now)) if floor <= now else now
