"""Job logs within bounds, the background half (the leader's, once a minute).

Each attempt's stream is capped as its chunks arrive (`--log-max-mib`, in agent_reports); this pass
does what no single append can: logs of allocations that ended more than `--log-keep-days` ago are
deleted, and a tenant whose logs together pass `--tenant-log-max-mib` loses its oldest chunks
first (each stream that lost some says so in a line where they were, as the per-stream cap does).
Between two passes a tenant may be over by what its jobs write in a minute, each stream capped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from computepool.server.loops import Periodic
from computepool.server.settings import ServerSettings
from computepool.store import logs
from computepool.store.db import Database, db_now

LOG_PASS_S = 60.0
RETENTION_BATCH = 500  # allocations whose logs one transaction deletes
log = logging.getLogger("computepool.server")


@dataclass
class LogPassReport:
    expired: int = 0  # allocations whose logs were deleted
    dropped: dict[str, int] = field(default_factory=dict)  # tenant → bytes dropped over its cap


class LogLimits:
    """The log pass; `run_once` is one pass (tests call it with their own `now`)."""

    def __init__(self, db: Database, settings: ServerSettings) -> None:
        self.db, self.settings = db, settings

    def periodic(self) -> Periodic:
        return Periodic("log-limits", LOG_PASS_S, self.run_once, leader_only=True)

    def run_once(self, now: datetime | None = None) -> LogPassReport:
        """One pass at `now` (default: the database's clock)."""
        report = LogPassReport()
        if now is None:
            with self.db.read() as s:
                now = db_now(s)
        cutoff = now - timedelta(days=self.settings.log_keep_days)
        while True:
            with self.db.write() as s:
                n = logs.drop_ended_before(s, cutoff, RETENTION_BATCH)
            report.expired += n
            if n < RETENTION_BATCH:
                break
        cap = self.settings.tenant_log_max_mib << 20
        with self.db.read() as s:
            over = [t for t, total in logs.tenant_bytes(s).items() if total > cap]
        for tenant in over:
            with self.db.write() as s:
                report.dropped[tenant] = logs.cap_tenant(s, tenant, cap)
            log.warning(
                "tenant %s: %d bytes of its oldest job output dropped (over --tenant-log-max-mib %d)",
                tenant, report.dropped[tenant], self.settings.tenant_log_max_mib,
            )  # fmt: skip
        if report.expired:
            log.info("logs of %d allocation(s) ended before %s deleted", report.expired, cutoff.isoformat())
        return report
