"""A tenant's idle-reclaim policy: release allocations whose devices show no use for a while."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field, StrictInt

from computepool.wire.common import In, Out


class ReclaimPolicyIn(In):
    idle: StrictInt | str = Field(
        description="Release an allocation whose devices showed no use this long: seconds, or 90s, 30m, 2h."
    )
    warn: StrictInt | str = Field(
        default=0,
        description="Warn this long before the release (event, `cpool ps`, metric); 0: at the release pass.",
    )


class ReclaimPolicyOut(Out):
    tenant: str
    enabled: bool = Field(description="False: the tenant's allocations are never reclaimed for idleness.")
    idle_s: int | None = None
    warn_s: int | None = None
    updated_at: datetime | None = None
