"""The usage ledger: books GPU-hours, CPU-hours, memory-hours and energy of every allocation.

`Accountant` runs on the replica holding the scheduling lease, every `ledger_interval_s`. Each
pass, in one transaction fenced by the lease term, books the time since the ledger's clock (see
`accrual` for what is booked and how energy is measured and split), writes one history sample per
device at most once a minute, drops samples older than `history_keep_s`, and moves the clock. The
first pass ever books from the earliest bind it finds (no further back than `FIRST_LOOKBACK`), so
what a new pool ran before its first pass is booked whole, not from the pass on.

Every allocation books exactly the time it held devices, from its bind to its end, however short
and however long the pass: allocations ended since the last pass keep their slices and are booked
to their end. A requeue drops the slices of the attempt it ends, so the Accountant remembers what
it saw held at its previous pass and books such an attempt up to its requeue event. What it cannot
book: an attempt bound and requeued between two passes (never seen with its slices), and the tail
of an attempt requeued while no leader had booked since it was seen (a failover in between).

A gap (no leader for a while, the server down) is booked in full: use times are known from bind
and end times, and an energy counter's difference covers the whole gap exactly. Where a device has
no counter, its power estimate covers only the last `MAX_GAP_INTERVALS` intervals of the gap.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from computepool.server.hub import Hub
from computepool.server.leadership import Leadership
from computepool.server.ledger.accrual import DeviceState, Holding, accrue
from computepool.server.loops import Periodic
from computepool.server.settings import ServerSettings
from computepool.store import usage as sql
from computepool.store.db import Database, db_now

log = logging.getLogger("computepool.server")
MAX_GAP_INTERVALS = 3  # a power estimate covers at most this many intervals of a longer gap
SAMPLE_EVERY = timedelta(minutes=1)  # device history resolution
FIRST_LOOKBACK = timedelta(days=1)  # the first pass books binds this old at most (an old pool's history)


@dataclass(frozen=True)
class LedgerReport:
    leader: bool
    booked_s: float = 0.0  # seconds booked by this pass
    entries: int = 0  # ledger rows added to


def holding_of(row: sql.HeldRow) -> Holding:
    """An allocation as the accrual sees it: its slices, its host share on each node, and when it
    held them."""
    cpu = int(row.request.get("cpu_milli") or 0)
    mem = int(row.request.get("memory_mib") or 0)
    return Holding(
        id=row.id,
        tenant=row.tenant,
        user=row.owner,
        job=row.name,
        service=row.service,
        slices=tuple(
            (str(sl["node"]), int(sl["device_index"]), int(sl["compute_milli"])) for sl in row.slices
        ),
        host=tuple((node, cpu, mem) for node in row.nodes),
        since=row.bound_at,
        until=row.ended_at,
    )


class Accountant:
    """Books use and energy every `ledger_interval_s` on the leader; `run_once` is one pass."""

    def __init__(self, db: Database, settings: ServerSettings, hub: Hub, leadership: Leadership) -> None:
        self.db, self.settings, self.hub, self.leadership = db, settings, hub, leadership
        self.auto = True
        self._lock = threading.Lock()
        # what the last committed pass saw held: (its clock, allocation id → (attempt, holding))
        self._seen: tuple[datetime, dict[int, tuple[int, Holding]]] | None = None

    def run_once(self, now: datetime | None = None) -> LedgerReport:
        """Book up to `now` (default: the database's clock; tests pass their own)."""
        with self._lock:
            term = self.leadership.term
            if term is None:
                return LedgerReport(leader=False)
            with self.db.write() as s:
                if not self.leadership.holds(s, term):
                    return LedgerReport(leader=False)
                if now is None:  # no further than the oldest open transaction (sql.open_since)
                    now = db_now(s)
                    opened = sql.open_since(s)
                    now = min(now, opened) if opened is not None else now
                report, seen = self._book(s, now)
            if seen is not None:  # committed: the next pass may rely on it
                self._seen = seen
            return report

    def _requeued(self, s: Session, last: datetime, rows: list[sql.HeldRow]) -> list[Holding]:
        """Attempts seen held at the previous pass and requeued since, up to their requeue."""
        if self._seen is None or self._seen[0] != last:
            return []
        now_attempt = {r.id: r.attempt for r in rows}
        gone = {i: a for i, (a, _) in self._seen[1].items() if now_attempt.get(i) != a}
        out = []
        for alloc_id, at in sql.requeued_at(s, gone).items():
            h = self._seen[1][alloc_id][1]
            out.append(replace(h, until=at))
        return out

    def _book(
        self, s: Session, now: datetime
    ) -> tuple[LedgerReport, tuple[datetime, dict[int, tuple[int, Holding]]] | None]:
        last = sql.clock(s)
        if last is not None and now <= last:
            return LedgerReport(leader=True), None
        devs = sql.devices(s)
        sampled = sql.last_sample_at(s)
        if sampled is None or now - sampled >= SAMPLE_EVERY:
            sql.add_samples(s, now, devs)
        sql.prune_samples(s, now - timedelta(seconds=self.settings.history_keep_s))
        if last is None:  # the first pass: from the earliest bind, what held devices before it
            floor = now - FIRST_LOOKBACK
            binds = [r.bound_at for r in sql.held(s, floor) if r.bound_at is not None]
            last = max(floor, min([now, *binds]))
            if last >= now:
                sql.set_clock(s, now)
                sql.set_marks(s, {d.id: d.energy_j for d in devs if d.mark_j != d.energy_j})
                return LedgerReport(leader=True), (now, {})
        rows = sql.held(s, last)
        seen = (now, {r.id: (r.attempt, holding_of(r)) for r in rows if r.ended_at is None})
        heard_after = now - timedelta(seconds=self.settings.lost_after_s)
        states = [
            DeviceState(d.node, d.index, d.model, d.utilization_pct, d.power_w, d.energy_j, d.mark_j,
                        heard=d.heartbeat_at >= heard_after,
                        board_share=d.compute_milli / 1000 if d.mig_parent_uuid else 1.0)
            for d in devs
        ]  # fmt: skip
        holdings = [holding_of(r) for r in rows] + self._requeued(s, last, rows)
        booking = accrue(
            last,
            now,
            holdings,
            states,
            slack_s=self.settings.heartbeat_interval_s,
            estimate_cap_s=MAX_GAP_INTERVALS * self.settings.ledger_interval_s,
        )
        entries = []
        for (hour, alloc, node, model), a in booking.entries.items():
            who = booking.labels[alloc]
            entries.append(
                sql.Entry(hour, alloc, who.tenant, who.user, who.job, who.service, node, model,
                          a.gpu_seconds, a.cpu_seconds, a.memory_mib_seconds, a.energy_j, a.idle_waste_j)
            )  # fmt: skip
        sql.book(s, entries)
        sql.set_marks(s, {d.id: d.energy_j for d in devs if d.mark_j != d.energy_j})
        sql.set_clock(s, now)
        report = LedgerReport(leader=True, booked_s=(now - last).total_seconds(), entries=len(entries))
        return report, seen

    def periodic(self) -> Periodic:
        return Periodic("ledger", self.settings.ledger_interval_s, self.run_once, enabled=lambda: self.auto)
