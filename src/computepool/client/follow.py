"""Followers ride out a control plane that is away for a while (a restart, a failover).

`cpool run`, `cpool logs -f` and the SDK's `.result()` follow a job that goes on running on its
node whatever happens to the control plane; ending the follow at the first refused connection or
500 would report a failure the job never had (`cpool run … && next` taking the wrong branch). Only
reads go through here: calling one again can do no harm.

How long an outage is ridden out is `CPOOL_OUTAGE_WAIT` (`cpool --outage-wait`, the SDK's
`Pool(outage_wait=...)`): a duration such as `30m` or `2h`, `0` to give up at the first failure;
15 minutes when unset.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from computepool.client.errors import PoolError, ServerUnreachable
from computepool.core.errors import InvalidInput
from computepool.core.quantities import parse_duration_s

T = TypeVar("T")
OUTAGE_S = 900.0  # a control plane away longer than this is down, not restarting: say so
OUTAGE_ENV = "CPOOL_OUTAGE_WAIT"
FIRST_PAUSE_S = 0.5
MAX_PAUSE_S = 5.0


def outage_wait_s(value: str | float | None = None, field: str = OUTAGE_ENV) -> float:
    """Seconds a follower waits for a control plane that is away: `value` (a duration: `90s`, `30m`,
    `2h`; `0`: not at all), else $CPOOL_OUTAGE_WAIT, else 15 minutes. Raises InvalidInput naming
    `field` for a value that is not a duration."""
    raw = os.environ.get(OUTAGE_ENV) if value is None else value
    if isinstance(raw, str):
        raw = raw.strip()
        if not raw:
            return OUTAGE_S
        if raw.rstrip("s") in ("0", "0.0"):
            return 0.0
    elif raw is None:
        return OUTAGE_S
    elif raw == 0:
        return 0.0
    try:
        return float(parse_duration_s(raw, field))
    except InvalidInput as e:
        raise InvalidInput(
            field, f"{e.message} (how long to wait for a control plane that is away)"
        ) from None


def passing(e: Exception) -> bool:
    """Whether an error can be an outage that passes: no answer, or a server fault (5xx)."""
    return isinstance(e, ServerUnreachable) or (isinstance(e, PoolError) and e.status >= 500)


@dataclass
class OutageRider:
    """Calls a read again, backing off, while the control plane gives no useful answer, for up to
    `outage_s` in a row; `on_outage` hears once per outage what went wrong, `on_back` when it ends."""

    outage_s: float = field(default_factory=outage_wait_s)
    on_outage: Callable[[Exception], None] | None = None
    on_back: Callable[[], None] | None = None
    sleep: Callable[[float], None] = field(default=time.sleep)
    clock: Callable[[], float] = field(default=time.monotonic)

    def call(self, read: Callable[[], T]) -> T:
        since: float | None = None
        pause = FIRST_PAUSE_S
        while True:
            try:
                out = read()
            except (ServerUnreachable, PoolError) as e:
                if not passing(e):
                    raise
                now = self.clock()
                if since is None:
                    since = now
                    if self.on_outage is not None:
                        self.on_outage(e)
                if now - since >= self.outage_s:
                    raise
                self.sleep(pause)
                pause = min(pause * 2, MAX_PAUSE_S)
                continue
            if since is not None and self.on_back is not None:
                self.on_back()
            return out
