"""The scheduling loop of one server process: lease → snapshot → decide → fenced commit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from computepool.server.hub import Hub
from computepool.server.scheduling.commit import CommitResult, LostLease, commit
from computepool.server.scheduling.decide import decide
from computepool.server.scheduling.snapshot import SnapshotCache
from computepool.server.settings import ServerSettings
from computepool.store import allocations as store
from computepool.store.db import Database, db_now

log = logging.getLogger("computepool.server")

LEASE_TTL_S = 10.0
CYCLE_INTERVAL_S = 1.0


@dataclass
class CycleReport:
    leader: bool
    term: int = 0
    seconds: float = 0.0
    decide_seconds: float = 0.0
    pending: int = 0
    result: CommitResult | None = None
    snapshot_seconds: float = 0.0
    commit_seconds: float = 0.0


class Controller:
    """The scheduling loop of one server process: woken by `Hub.wake_scheduler` or every second."""

    def __init__(
        self,
        db: Database,
        settings: ServerSettings,
        hub: Hub,
        *,
        observe: Callable[[float], None] | None = None,
        interval_s: float = CYCLE_INTERVAL_S,
        lease_ttl_s: float = LEASE_TTL_S,
        holder: str | None = None,
    ) -> None:
        self.db = db
        self.settings = settings
        self.hub = hub
        self.observe = observe
        self.interval_s = interval_s
        self.lease_ttl_s = lease_ttl_s
        self.holder = holder or f"{uuid.uuid4().hex[:16]}"
        self.auto = True  # tests turn the background loop off and call run_once
        self._lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None
        self._snapshots = SnapshotCache()
        self._term: int | None = None  # the lease term held, as of the last renewal
        self._renewed = 0.0

    def acquire(self) -> int | None:
        """Take or renew the lease in the database; the term, or None while another replica holds it."""
        with self.db.write() as s:
            term = store.acquire_lease(s, self.holder, db_now(s), self.lease_ttl_s)
        self._term, self._renewed = term, time.monotonic()
        return term

    @property
    def leader(self) -> bool:
        """Whether this process held the scheduling lease at its last renewal, within its TTL."""
        return self._term is not None and time.monotonic() - self._renewed < self.lease_ttl_s

    @property
    def term(self) -> int | None:
        """The lease term this process holds (as of its last renewal, within its TTL), else None.
        Other controllers of the leader (time limits, idle reclaim) fence their writes with it."""
        return self._term if self.leader else None

    def _held_term(self) -> int | None:
        """The term, renewing the lease only once a third of its time has passed: a busy pool
        runs many cycles a second, and each renewal is a write. Commits stay fenced by the term
        in the database, so a lease lost meanwhile writes nothing."""
        if self._term is not None and time.monotonic() - self._renewed < self.lease_ttl_s / 3:
            return self._term
        return self.acquire()

    def run_once(self) -> CycleReport:
        """One cycle (thread-safe; cycles of one process never overlap)."""
        with self._lock:
            t0 = time.perf_counter()
            term = self._held_term()
            if term is None:
                return CycleReport(leader=False)
            with self.db.read() as s:
                lost_before = db_now(s) - timedelta(seconds=self.settings.lost_after_s)
                if not store.needs_cycle(s, lost_before):  # idle pool: nothing pending, no node lost
                    return CycleReport(True, term, time.perf_counter() - t0, 0.0, 0, CommitResult())
                snap = self._snapshots.load(s, self.settings)
            t1 = time.perf_counter()
            plan = decide(snap)
            t2 = time.perf_counter()
            try:
                ports = (self.settings.gang_port_min, self.settings.gang_port_max)
                result = commit(self.db, plan, self.holder, term, gang_ports=ports)
            except LostLease:
                self._term = None
                if self.acquire() != term:  # another replica schedules now
                    return CycleReport(leader=False)
                raise
            t3 = time.perf_counter()
            elapsed = t3 - t0
            if self.observe is not None:
                self.observe(elapsed)
            self.hub.notify(*(f"node:{n}" for n in result.nodes))
            self.hub.notify(*(f"logs:{i}" for i in result.stopped))
            self.hub.notify(*(f"alloc:{i}" for i in (*result.bound, *result.stopped)))
            if result.requeued:  # moved work waits in the queue: place it without waiting a second
                self.hub.wake_scheduler()
            pending = sum(1 for a in snap.live if a.state == "pending")
            return CycleReport(True, term, elapsed, t2 - t1, pending, result, t1 - t0, t3 - t2)

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.hub.scheduler_event.wait(), self.interval_s)
            self.hub.scheduler_event.clear()
            if not self.auto:
                continue
            try:
                await asyncio.to_thread(self.run_once)
            except LostLease as e:
                log.info("scheduling: %s", e)
            except Exception:  # the loop must survive a bad cycle (database away, bug): log, go on
                log.exception("scheduling cycle failed")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="cpool-scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with self._lock:  # let a cycle running in a thread finish before the engine closes
            pass
