"""The usage ledger: books GPU-hours, CPU-hours, memory-hours and energy of every allocation.

`Accountant` runs on the replica holding the scheduling lease, every `ledger_interval_s`. Each
pass, in one transaction fenced by the lease term, books the time since the ledger's clock (see
`accrual` for what is booked and how energy is measured and split), writes one history sample per
device, drops samples older than `history_keep_s`, and moves the clock. A gap longer than three
intervals (no leader for a while, the server down) is not guessed at: only its last three
intervals are booked, by reported power rather than by the energy counter, whose difference would
cover the whole gap. The first pass ever only starts the clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from computepool.server.hub import Hub
from computepool.server.ledger.accrual import DeviceState, Holding, accrue
from computepool.server.scheduling import Controller
from computepool.server.settings import ServerSettings
from computepool.store import allocations as alloc_store
from computepool.store import usage as sql
from computepool.store.db import Database, db_now

log = logging.getLogger("computepool.server")
MAX_GAP_INTERVALS = 3


@dataclass(frozen=True)
class LedgerReport:
    leader: bool
    booked_s: float = 0.0  # seconds booked by this pass
    entries: int = 0  # ledger rows added to


def holding_of(row: sql.HeldRow) -> Holding:
    """A held allocation as the accrual sees it: its slices and its host share on each node."""
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
    )


class Accountant:
    """Books use and energy every `ledger_interval_s` on the leader; `run_once` is one pass."""

    def __init__(self, db: Database, settings: ServerSettings, hub: Hub, controller: Controller) -> None:
        self.db, self.settings, self.hub, self.controller = db, settings, hub, controller
        self.auto = True
        self._lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None

    def run_once(self, now: datetime | None = None) -> LedgerReport:
        """Book up to `now` (default: the database's clock; tests pass their own)."""
        with self._lock:
            term = self.controller.term
            if term is None:
                return LedgerReport(leader=False)
            with self.db.write() as s:
                if not alloc_store.holds_lease(s, self.controller.holder, term):
                    return LedgerReport(leader=False)
                return self._book(s, now or db_now(s))

    def _book(self, s: Session, now: datetime) -> LedgerReport:
        last = sql.clock(s)
        if last is not None and now <= last:
            return LedgerReport(leader=True)
        devs = sql.devices(s)
        sql.add_samples(s, now, devs)
        sql.prune_samples(s, now - timedelta(seconds=self.settings.history_keep_s))
        if last is None:
            sql.set_clock(s, now)
            sql.set_marks(s, {d.id: d.energy_j for d in devs if d.mark_j != d.energy_j})
            return LedgerReport(leader=True)
        cap = timedelta(seconds=MAX_GAP_INTERVALS * self.settings.ledger_interval_s)
        start = max(last, now - cap)
        heard_after = now - timedelta(seconds=self.settings.lost_after_s)
        states = [
            DeviceState(d.node, d.index, d.model, d.utilization_pct, d.power_w, d.energy_j, d.mark_j,
                        heard=d.heartbeat_at >= heard_after,
                        board_share=d.compute_milli / 1000 if d.mig_parent_uuid else 1.0)
            for d in devs
        ]  # fmt: skip
        booking = accrue(
            start, now, [holding_of(h) for h in sql.held(s)], states, trust_counter=start == last
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
        return LedgerReport(leader=True, booked_s=(now - start).total_seconds(), entries=len(entries))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.ledger_interval_s)
            if not self.auto:
                continue
            try:
                await asyncio.to_thread(self.run_once)
            except Exception:  # the loop must survive a bad pass (database away): log, go on
                log.exception("usage ledger: pass failed")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="cpool-ledger")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with self._lock:
            pass
