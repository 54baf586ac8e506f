"""Time limits and idle reclaim: the control plane ends allocations that ran out of time, or that
hold devices nobody uses, so that capacity goes back to the pool.

- *Time limit* (`time_limit` in the request, seconds): an allocation bound for longer than its
  limit ends `failed` with the reason "time limit 2h reached". The clock counts the current
  attempt from its bind (as Slurm does, a requeued attempt gets the whole limit again); a limit
  is a limit, so reaching it ends restartable work too instead of requeueing it.
- *Idle reclaim*, a per-tenant policy (off unless set): an allocation holding devices whose
  heartbeats show no use — utilization 0 and device memory unchanged — on every one of its
  devices for `idle_s` is released. `warn_s` before that it is warned: an event in its history
  ("idle: …"), shown by `cpool ps` and `cpool explain`, and a metric. Use lifts the warning.
  A device shared with others (timeslice, MPS) shows their use too, which keeps the allocation:
  reclaim errs on the side of not taking work away. Devices whose node has not reported for
  `suspect_after_s` say nothing, and idleness restarts once they report again.

Runs on the replica that holds the scheduling lease, every `reclaim_interval_s`; its writes are
fenced by the lease term like the scheduler's. Idleness is tracked in memory: a new leader starts
counting afresh (and warns again) rather than release anything early. Every end and warning is an
audit record of the scheduler.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from prometheus_client import CollectorRegistry, Counter, Gauge

from computepool.core.allocation import HOLDING, AllocationState
from computepool.core.quantities import format_duration
from computepool.server import topics
from computepool.server.hub import Hub
from computepool.server.leadership import Leadership
from computepool.server.loops import Periodic
from computepool.server.settings import ServerSettings
from computepool.store import allocations as alloc_store
from computepool.store import reclaim as sql
from computepool.store.db import Database, db_now
from computepool.store.scheduling import audit_scheduler

log = logging.getLogger("computepool.server")
IDLE_PREFIX = "idle:"
IN_USE_PREFIX = "in use again:"
TIME_LIMIT_WORDS = "time limit"


def human(seconds: float) -> str:
    """90 → '1m30s': durations as people write them (never negative)."""
    return format_duration(max(0, round(seconds)))


def time_left_s(request: dict[str, object], bound_at: datetime | None, now: datetime) -> float | None:
    """Seconds until the time limit of a bound allocation (None without a limit or a bind)."""
    limit = request.get("time_limit")
    if not isinstance(limit, int | float) or limit <= 0 or bound_at is None:
        return None
    return float(limit) - (now - bound_at).total_seconds()


def holding_notes(
    request: dict[str, object], bound_at: datetime | None, reason: str, now: datetime
) -> list[str]:
    """What `cpool explain` adds for a bound or active allocation: time left, an idle warning."""
    out = []
    left = time_left_s(request, bound_at, now)
    if left is not None:
        limit = float(str(request["time_limit"]))
        out.append(f"{TIME_LIMIT_WORDS} {human(limit)}: {human(left)} left")
    if reason.startswith(IDLE_PREFIX):
        out.append(reason)
    return out


@dataclass
class _End:
    id: int
    attempt: int
    state: AllocationState
    reason: str
    action: str
    tenant: str


@dataclass
class _Note:
    id: int
    attempt: int
    reason: str
    action: str


@dataclass
class ReclaimReport:
    leader: bool
    ended: list[int] = field(default_factory=list)
    warned: list[int] = field(default_factory=list)


class Reclaimer:
    """Applies time limits and idle-reclaim policies; `run_once` is one pass (tests call it)."""

    def __init__(
        self,
        db: Database,
        settings: ServerSettings,
        hub: Hub,
        leadership: Leadership,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.db, self.settings, self.hub, self.leadership = db, settings, hub, leadership
        self.auto = True
        self._idle_since: dict[tuple[int, int], datetime] = {}
        self._warned: dict[tuple[int, int], datetime] = {}
        self._memory: dict[tuple[str, int], int | None] = {}
        self._lock = threading.Lock()
        self.ends = Counter(
            "cpool_reclaim_ends_total",
            "Allocations ended by the control plane: time limit reached or idle reclaim.",
            ["tenant", "cause"],
            registry=registry,
        )
        self.warnings = Counter(
            "cpool_idle_warnings_total", "Idle-reclaim warnings given.", ["tenant"], registry=registry
        )
        self.warned_now = Gauge(
            "cpool_idle_warned_allocations",
            "Allocations warned as idle and not yet used again or released.",
            ["tenant"],
            registry=registry,
        )

    def run_once(self, now: datetime | None = None) -> ReclaimReport:
        """One pass at `now` (default: the database's clock; tests pass their own)."""
        with self._lock:
            term = self.leadership.term  # the scheduling loop holds and renews the lease
            if term is None:
                self._idle_since.clear()
                self._warned.clear()
                return ReclaimReport(leader=False)
            with self.db.read() as s:
                now = now or db_now(s)
                held = sql.held(s)
                policies = sql.policies(s)
                devices = sql.device_usage(s) if policies else {}
            ends, notes = self._decide(now, held, policies, devices)
            if not ends and not notes:
                return ReclaimReport(leader=True)
            return self._commit(term, ends, notes, now)

    def _decide(
        self,
        now: datetime,
        held: list[sql.Held],
        policies: dict[str, sql.Policy],
        devices: dict[tuple[str, int], sql.DeviceSeen],
    ) -> tuple[list[_End], list[_Note]]:
        ends: list[_End] = []
        notes: list[_Note] = []
        keys = {(h.id, h.attempt) for h in held}
        for gone in set(self._idle_since) - keys:
            self._idle_since.pop(gone, None)
        for gone in set(self._warned) - keys:
            self._warned.pop(gone, None)
        fresh_after = now - timedelta(seconds=self.settings.suspect_after_s)
        for h in held:
            left = time_left_s(h.request, h.bound_at, now)
            if left is not None and left <= 0:
                limit = human(float(h.request["time_limit"]))
                ends.append(_End(h.id, h.attempt, "failed", f"{TIME_LIMIT_WORDS} {limit} reached",
                                 "allocation.time-limit", h.tenant))  # fmt: skip
                continue
            policy = policies.get(h.tenant)
            if policy is None or not h.slices:
                continue
            end, note = self._idle(h, policy, devices, now, fresh_after)
            if end is not None:
                ends.append(end)
            if note is not None:
                notes.append(note)
        self._memory = {k: d.used_memory_mib for k, d in devices.items()}
        counts: dict[str, int] = {}
        tenants = {h.id: h.tenant for h in held}
        for alloc_id, _attempt in self._warned:
            counts[tenants[alloc_id]] = counts.get(tenants[alloc_id], 0) + 1
        for tenant in set(policies) | set(counts):
            self.warned_now.labels(tenant).set(counts.get(tenant, 0))
        return ends, notes

    def _idle(
        self,
        h: sql.Held,
        policy: sql.Policy,
        devices: dict[tuple[str, int], sql.DeviceSeen],
        now: datetime,
        fresh_after: datetime,
    ) -> tuple[_End | None, _Note | None]:
        key = (h.id, h.attempt)
        seen = [devices.get((str(sl["node"]), int(sl["device_index"]))) for sl in h.slices]
        if any(d is None or d.heartbeat_at < fresh_after or d.utilization_pct is None for d in seen):
            self._idle_since.pop(key, None)  # nothing known: never reclaim on silence
            return None, None
        busy = False
        for sl, d in zip(h.slices, seen, strict=True):
            assert d is not None
            before = self._memory.get((str(sl["node"]), int(sl["device_index"])), d.used_memory_mib)
            if (d.utilization_pct or 0.0) > 0.0 or d.used_memory_mib != before:
                busy = True
        if busy:
            self._idle_since.pop(key, None)
            if self._warned.pop(key, None) is not None:
                return None, _Note(h.id, h.attempt, f"{IN_USE_PREFIX} idle reclaim called off",
                                   "allocation.idle-cleared")  # fmt: skip
            return None, None
        since = self._idle_since.setdefault(key, now)
        idle_for = (now - since).total_seconds()
        warned_at = self._warned.get(key)
        if warned_at is None and idle_for >= policy.idle_s - policy.warn_s:
            self._warned[key] = now
            self.warnings.labels(h.tenant).inc()
            left = human(policy.idle_s - idle_for)
            reason = (
                f"{IDLE_PREFIX} no device use for {human(idle_for)}; released in {left} unless used "
                f"(tenant {h.tenant}: idle reclaim after {human(policy.idle_s)})"
            )
            return None, _Note(h.id, h.attempt, reason, "allocation.idle-warn")
        if (
            warned_at is not None
            and idle_for >= policy.idle_s
            and (now - warned_at).total_seconds() >= min(policy.warn_s, policy.idle_s)
        ):
            reason = f"reclaimed: devices idle for {human(idle_for)} (tenant {h.tenant}'s policy)"
            return _End(h.id, h.attempt, "released", reason, "allocation.reclaim", h.tenant), None
        return None, None

    def _commit(self, term: int, ends: list[_End], notes: list[_Note], judged_at: datetime) -> ReclaimReport:
        report = ReclaimReport(leader=True)
        touched: set[str] = set()
        with self.db.write() as s:
            if not self.leadership.holds(s, term):
                return ReclaimReport(leader=False)
            now = max(db_now(s), judged_at)  # a test's clock may run ahead of the database's
            for e in ends:
                a = alloc_store.get(s, e.id, for_update=True)
                if a is None or a.attempt != e.attempt or a.state not in HOLDING:
                    continue
                touched.update(a.nodes)
                alloc_store.transition(s, a, e.state, e.reason, now, term=term)
                audit_scheduler(s, now, e.action, a, term, {"reason": e.reason})
                self.ends.labels(e.tenant, "time-limit" if e.state == "failed" else "idle").inc()
                if self._warned.pop((e.id, e.attempt), None) is not None:
                    self.warned_now.labels(e.tenant).dec()
                report.ended.append(e.id)
            for n in notes:
                a = alloc_store.get(s, n.id)
                if a is None or a.attempt != n.attempt or a.state not in HOLDING:
                    continue
                a.reason = n.reason[:1024]  # `cpool ps` shows it in the reason column
                sql.add_note(s, a, n.reason, now)
                audit_scheduler(s, now, n.action, a, term, {"reason": n.reason})
                report.warned.append(n.id)
        for e in ends:
            log.info("allocation %d: %s", e.id, e.reason)
        if report.ended:
            self.hub.notify(*topics.nodes(touched), *topics.ended(report.ended))
            self.hub.wake_scheduler()  # the capacity is free: place what waits
        if report.warned:
            self.hub.notify(*topics.allocs(report.warned))
        return report

    def periodic(self) -> Periodic:
        return Periodic("reclaim", self.settings.reclaim_interval_s, self.run_once, enabled=lambda: self.auto)
