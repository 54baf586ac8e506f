"""The service controller: keeps each model service's replicas healthy and sized to its load.

Once a second, on the replica holding the scheduling lease (its writes fenced by the lease term,
as reclaim.py's are), it:

- checks the health path of every running replica (HTTP GET, all at once, each bounded to 2 s in
  all and 4 KiB read, so that one tenant's slow engine delays no other service's pass): a
  starting replica that answers 2xx is `ready` (the gateways route to it); a ready one that
  fails three checks in a row is cancelled ("unhealthy: …"), and so is one still starting
  `startup_grace_s` after it began to run ("not healthy within N s"); both are replaced. After
  three such failures within two minutes a service waits 30 s before its next replica;
- sizes the service from the gateways' fresh load reports: need = ⌈(in flight + queued) /
  target_inflight⌉, clamped to [min_replicas, max_replicas]; more replicas start at once, fewer
  only once `need` stayed below the current count for `scale_down_delay_s`, one at a time; with
  min_replicas 0 and no request for `idle_s` the service goes to zero, and a queued request
  (the gateway's report) wakes it again;
- replaces replicas of an older generation one by one: one new replica beyond the desired
  count, and an old one drained once it is ready;
- releases draining replicas when no gateway reports a request in flight on them — counting
  only reports written after the gateways saw it draining — or after `drain_s`. A replica that
  is not running (pending, or requeued after its node was lost) is cancelled instead of drained;
- gives each new replica a port no live replica holds and none that ended in the last five
  minutes (its engine may still be stopping), taking the ports in turn, and starts no replica
  beyond the tenant's `max_replicas_per_tenant`. A port an agent found another process taking
  (its replica's listener "other": that process takes the connections to the node's address and
  port) goes to no new replica for ten minutes while other ports are free. A listener of another
  process that takes none of them (an IPv6-only `[::]:P` beside the engine's `0.0.0.0:P`) is
  not "other" (agent/listeners.py): it never holds a replica back nor replaces it.

Health failures in a row and the scale-down clocks live in memory: a new leader starts them
afresh, which only ever delays a removal.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from pydantic import ValidationError
from sqlalchemy.orm import Session

from computepool.core.allocation import LIVE, AllocationState
from computepool.core.quantities import format_duration
from computepool.core.states import ReplicaState
from computepool.server import topics
from computepool.server.errors import Invalid
from computepool.server.hub import Hub
from computepool.server.leadership import Leadership
from computepool.server.logic import blobs as blob_service
from computepool.server.logic import images, replica_health, request_defaults
from computepool.server.logic.replica_health import Probe
from computepool.server.logic.service_load import Load, fresh_load
from computepool.server.logic.services import replica_request
from computepool.server.loops import Periodic
from computepool.server.settings import ServerSettings
from computepool.store import allocations as alloc_store
from computepool.store import logs as log_store
from computepool.store import services as store
from computepool.store.db import Database, db_now
from computepool.wire.services import ServiceSpec

log = logging.getLogger("computepool.server")
PASS_EVERY_S = 1.0
LOAD_FRESH_S = 5.0  # gateways' load reports older than this are ignored (as fresh_load does)
# A replica drains once reports written this long after it began draining show nothing in flight
# on it: a gateway re-reads its routing table every 0.5 s and reports every 0.5 s, with margin.
DRAIN_SETTLE_S = 1.5
PORT_COOLDOWN_S = 300.0  # a port whose replica ended is not given again for this long
FAILS_TO_UNHEALTHY = 3
BACKOFF_FAILURES = 3  # this many replica failures …
BACKOFF_WINDOW_S = 120.0  # … within this long …
BACKOFF_S = 30.0  # … and the next replica waits this long after the last one
EVENT_SHOWN_S = 60.0  # a replacement stays in the service's reason this long
SQUATTED_AVOID_S = 600.0  # a port another process held goes to no replica this long while others are free


def human(seconds: float) -> str:
    return format_duration(max(0, round(seconds)))


@dataclass
class _View:
    now: datetime
    services: dict[int, store.ServiceRow]
    replicas: dict[int, list[store.ReplicaRow]]
    loads: dict[int, Load]
    reports: dict[int, datetime]  # service → its oldest fresh load report
    failed: list[tuple[int, int, str, datetime]]  # replicas that ended failed lately


@dataclass
class _Plan:
    states: list[tuple[int, int, ReplicaState]] = field(default_factory=list)  # (allocation, attempt, state)
    ends: list[tuple[int, int, AllocationState, str]] = field(
        default_factory=list
    )  # (allocation, attempt, state, why)
    starts: dict[int, int] = field(default_factory=dict)  # service → replicas to start
    decisions: dict[int, tuple[int, str]] = field(default_factory=dict)  # service → (desired, reason)


@dataclass
class PassReport:
    leader: bool
    started: list[int] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)
    ready: list[int] = field(default_factory=list)
    draining: list[int] = field(default_factory=list)


def _own_port(r: store.ReplicaRow) -> bool:
    """Whether the replica may be probed (showing its key): a starting one once its agent saw its own
    process listen on the port; a ready one unless another process was found there (it is then
    replaced; one that stopped listening fails its checks)."""
    if r.replica_state == "ready":
        return r.listener != "other"
    return r.listener == "own"


def _ready(r: store.ReplicaRow) -> bool:
    return r.state == "active" and r.replica_state == "ready"


class ServiceController:
    """Runs `run_once` every second on the app's loop; tests set `auto = False` and call it."""

    def __init__(self, db: Database, settings: ServerSettings, hub: Hub, leadership: Leadership) -> None:
        self.db, self.settings, self.hub, self.leadership = db, settings, hub, leadership
        self.auto = True
        self._fails: dict[int, int] = {}  # allocation → failed health checks in a row
        self._below: dict[int, datetime] = {}  # service → since when fewer replicas would do
        self._failures: dict[int, list[datetime]] = {}  # service → when replicas failed
        self._event: dict[int, tuple[str, datetime]] = {}  # service → last replacement, for `reason`
        self._seen_failed: set[int] = set()  # replicas that ended failed, already counted
        self._next_port: int | None = None  # where the search for a free port starts (round-robin)
        self._squatted: dict[int, datetime] = {}  # port → when another process was found holding it

    # --- one pass -----------------------------------------------------------------------------
    async def run_once(self, now: datetime | None = None) -> PassReport:
        """One pass at `now` (default: the database's clock; tests pass their own)."""
        term = self.leadership.term
        if term is None:
            self._fails.clear()
            self._below.clear()
            return PassReport(leader=False)
        view = await asyncio.to_thread(self._read, now)
        health = await self._probe(view)
        plan = self._decide(view, health)
        return await asyncio.to_thread(self._commit, term, plan, view.now)

    def _read(self, now: datetime | None) -> _View:
        with self.db.read() as s:
            now = now or db_now(s)
            svcs = {v.id: v for v in store.list_services(s, None)}
            svcs.update(store.by_ids(s, [i for i in store.services_with_replicas(s) if i not in svcs]))
            reps: dict[int, list[store.ReplicaRow]] = {}
            for r in store.replicas(s, None):
                reps.setdefault(r.service_id, []).append(r)
            loads = fresh_load(s, list(svcs), now, LOAD_FRESH_S)
            reports = store.oldest_reports(s, list(svcs), now - timedelta(seconds=LOAD_FRESH_S))
            failed = [  # a new failure says what its engine last wrote on stderr
                (i, sid, why if i in self._seen_failed else why + _stderr_said(s, i), at)
                for i, sid, why, at in store.failed_since(s, now - timedelta(seconds=BACKOFF_WINDOW_S))
            ]
        return _View(now, svcs, reps, loads, reports, failed)

    async def _probe(self, view: _View) -> dict[int, Probe]:
        """GET each running replica's health path, showing its key as the gateway does (an engine
        started with the key may refuse every other caller, its health path included)."""
        targets: list[tuple[int, str, str | None]] = []
        for sid, reps in view.replicas.items():
            svc = view.services.get(sid)
            if svc is None or svc.deleted_at is not None:
                continue
            path = str(svc.spec.get("health_path") or "/health")
            for r in reps:
                probed = r.state == "active" and r.replica_state in (None, "starting", "ready")
                if probed and r.endpoint and _own_port(r):  # the key goes to the replica's process alone
                    targets.append((r.id, r.endpoint + path, r.key))
        return await replica_health.check_all(targets)

    # --- decisions ----------------------------------------------------------------------------
    def _decide(self, view: _View, health: dict[int, Probe]) -> _Plan:
        plan = _Plan()
        live = {r.id for reps in view.replicas.values() for r in reps}
        for gone in set(self._fails) - live:
            self._fails.pop(gone, None)
        for by_service in (self._failures, self._event, self._below):  # services gone for good
            for sid in set(by_service) - set(view.services):
                by_service.pop(sid, None)
        for alloc_id, sid, why, at in view.failed:  # an engine that exited with an error counts too
            if alloc_id not in self._seen_failed:
                self._seen_failed.add(alloc_id)
                self._count_failure(sid, f"replica {alloc_id} failed ({why}): replaced", at, view.now)
        self._seen_failed &= {f[0] for f in view.failed}
        for sid, svc in view.services.items():
            try:
                self._service(plan, view, svc, view.replicas.get(sid, []), health)
            except ValidationError as e:  # a spec stored by an older version that no longer reads
                self._note(plan, svc, f"spec unreadable, nothing changed: {e.errors()[0]['msg']}")
        return plan

    def _service(
        self,
        plan: _Plan,
        view: _View,
        svc: store.ServiceRow,
        reps: list[store.ReplicaRow],
        health: dict[int, Probe],
    ) -> None:
        now = view.now
        spec = ServiceSpec.model_validate(svc.spec)
        load = view.loads.get(svc.id)
        per = load.per_replica if load else {}
        current = self._current(plan, view, svc, spec, reps, health, per)
        if svc.deleted_at is not None:
            return
        if spec.cooperative is not None and not spec.request.command:
            return self._await_coop_plan(plan, svc, current)
        # replicas of an older generation that serve nothing are simply cancelled
        why_old = f"replaced by generation {svc.generation}"
        for r in [r for r in current if r.generation < svc.generation and not _ready(r)]:
            plan.ends.append((r.id, r.attempt, "cancelled", why_old))
            current.remove(r)
        total = (load.inflight + load.queued) if load else 0
        idle_for = (now - (svc.last_request_at or svc.created_at)).total_seconds()
        idle = spec.min_replicas == 0 and total == 0 and idle_for >= spec.idle_s
        desired = _desired(spec, len(current), total, idle)
        start, notes = self._resize(plan, svc, spec, current, per, desired, idle, now)
        wait = self._backoff(svc.id, now)
        if start and wait is not None:
            notes.append(
                f"replicas keep failing ({BACKOFF_FAILURES} or more in {human(BACKOFF_WINDOW_S)}): "
                f"next one in {human(wait)}"
            )
            start = 0
        if start:
            plan.starts[svc.id] = start
        reason = self._reason(spec, desired, total, idle, idle_for)
        event = self._event.get(svc.id)
        if event is not None and (now - event[1]).total_seconds() < EVENT_SHOWN_S:
            notes.append(event[0])
        text = "; ".join([reason, *notes])
        if (desired, text) != (svc.desired, svc.reason):
            plan.decisions[svc.id] = (desired, text)

    def _current(
        self,
        plan: _Plan,
        view: _View,
        svc: store.ServiceRow,
        spec: ServiceSpec,
        reps: list[store.ReplicaRow],
        health: dict[int, Probe],
        per: dict[int, int],
    ) -> list[store.ReplicaRow]:
        """The replicas that count toward the service's size, after this pass's health results;
        draining ones are followed to their end, and a deleted service's retired."""
        current: list[store.ReplicaRow] = []
        for r in reps:
            if r.replica_state == "draining":
                self._drain(plan, svc, spec, r, per, view.reports.get(svc.id), view.now)
            elif svc.deleted_at is not None:
                self._retire(plan, r, "service deleted")
            elif (kept := self._health(plan, svc, spec, r, health.get(r.id), view.now)) is not None:
                current.append(kept)
        return current

    def _await_coop_plan(self, plan: _Plan, svc: store.ServiceRow, current: list[store.ReplicaRow]) -> None:
        """The coop controller has not placed the plan yet (or is re-planning): no replica."""
        for r in current:
            self._retire(plan, r, "cooperative service re-planning")
        why = "cooperative: waiting for the coop controller's plan (cpool services explain)"
        if (0, why) != (svc.desired, svc.reason):
            plan.decisions[svc.id] = (0, why)

    def _resize(
        self,
        plan: _Plan,
        svc: store.ServiceRow,
        spec: ServiceSpec,
        current: list[store.ReplicaRow],
        per: dict[int, int],
        desired: int,
        idle: bool,
        now: datetime,
    ) -> tuple[int, list[str]]:
        """Toward `desired` replicas: a rolling update first, else down after the delay (or to zero
        when idle), else up. (Replicas to start, notes for the reason.)"""
        n = len(current)
        start = max(0, desired - n)
        old = [r for r in current if r.generation < svc.generation]
        if old:
            self._below.pop(svc.id, None)
            unready_new = [r for r in current if r.generation >= svc.generation and not _ready(r)]
            if not unready_new and start == 0:
                if n > desired:
                    victim = min(old, key=lambda r: (per.get(r.id, 0), r.id))
                    plan.states.append((victim.id, victim.attempt, "draining"))
                else:
                    start = 1  # surge: one new replica beyond the desired count
            return start, [f"rolling update to generation {svc.generation}: {len(old)} old replicas left"]
        if desired >= n:
            self._below.pop(svc.id, None)
            return start, []
        since = self._below.setdefault(svc.id, now)
        if idle:
            for r in current:
                self._retire(plan, r, "drained: scaled to zero")
        elif (now - since).total_seconds() >= spec.scale_down_delay_s:
            victim = min(current, key=lambda r: (_ready(r), per.get(r.id, 0), r.id))
            self._retire(plan, victim, "drained: scaled down")
            self._below[svc.id] = now
        else:
            left = spec.scale_down_delay_s - (now - since).total_seconds()
            return start, [f"one fewer in {human(left)} unless the load comes back"]
        return start, []

    @staticmethod
    def _reason(spec: ServiceSpec, desired: int, total: int, idle: bool, idle_for: float) -> str:
        if idle and desired == 0:
            return f"scaled to zero: idle {human(idle_for)}"
        words = "replica" if desired == 1 else "replicas"
        if total == 0:
            return f"{desired} {words}: no requests in flight (min {spec.min_replicas})"
        return (
            f"{desired} {words}: {total} requests in flight or queued, target {spec.target_inflight} each"
            + (f" (max {spec.max_replicas})" if desired == spec.max_replicas and desired > 1 else "")
        )

    def _health(
        self,
        plan: _Plan,
        svc: store.ServiceRow,
        spec: ServiceSpec,
        r: store.ReplicaRow,
        probe: Probe | None,
        now: datetime,
    ) -> store.ReplicaRow | None:
        """The replica as it stands after this pass's health check; None when it is being replaced."""
        if r.state != "active":
            self._fails.pop(r.id, None)
            if r.replica_state not in (None, "starting"):  # requeued (node lost, preempted): not serving
                plan.states.append((r.id, r.attempt, "starting"))
                return _with(r, "starting")
            return r
        if r.listener == "other" and r.replica_state == "ready":  # its port changed hands: at once
            self._squatter(plan, svc.id, r, now)
            return None
        if r.replica_state in (None, "starting"):
            if r.listener == "other" and r.port is not None:  # no new replica is given it meanwhile
                self._squatted[r.port] = now
            # ready only when the health check passes AND the agent saw the replica's own process
            # listen on the port: on a shared network another job may bind it first and answer
            if probe is not None and probe.ok and r.listener == "own":
                plan.states.append((r.id, r.attempt, "ready"))
                return _with(r, "ready")
            began = r.started_at or r.since or now
            if (now - began).total_seconds() >= spec.startup_grace_s:
                if r.listener == "other":
                    self._squatter(plan, svc.id, r, now)
                    return None
                detail = f" (last check: {probe.detail})" if probe is not None and probe.detail else ""
                if not detail and r.listener != "own":
                    detail = f" (its process does not listen on port {r.port})"
                why = f"not healthy within {spec.startup_grace_s} s{detail}"
                self._failed(plan, svc.id, r, why, now)
                return None
            return r
        if r.replica_state == "ready" and probe is not None:
            if probe.ok:
                self._fails.pop(r.id, None)
                return r
            fails = self._fails.get(r.id, 0) + 1
            self._fails[r.id] = fails
            if fails >= FAILS_TO_UNHEALTHY:
                plan.states.append((r.id, r.attempt, "unhealthy"))
                self._failed(
                    plan, svc.id, r, f"unhealthy: {fails} health checks failed ({probe.detail})", now
                )
                return None
        return r

    def _squatter(self, plan: _Plan, sid: int, r: store.ReplicaRow, now: datetime) -> None:
        """Another process holds the replica's port: replace it, on another port if one is free."""
        if r.port is not None:
            self._squatted[r.port] = now
        self._failed(plan, sid, r, f"port {r.port} on node {r.node} is held by another process", now)

    def _failed(self, plan: _Plan, sid: int, r: store.ReplicaRow, why: str, now: datetime) -> None:
        plan.ends.append((r.id, r.attempt, "cancelled", why))
        self._fails.pop(r.id, None)
        self._count_failure(sid, f"replica {r.id} {why}: replaced", now, now)

    def _count_failure(self, sid: int, event: str, at: datetime, now: datetime) -> None:
        times = [t for t in self._failures.get(sid, []) if (now - t).total_seconds() < BACKOFF_WINDOW_S]
        self._failures[sid] = [*times, at]
        self._event[sid] = (event, at)

    def _backoff(self, sid: int, now: datetime) -> float | None:
        """Seconds before this service may start another replica, while its replicas keep failing."""
        times = [t for t in self._failures.get(sid, []) if (now - t).total_seconds() < BACKOFF_WINDOW_S]
        if len(times) < BACKOFF_FAILURES:
            return None
        left = BACKOFF_S - (now - max(times)).total_seconds()
        return left if left > 0 else None

    @staticmethod
    def _retire(plan: _Plan, r: store.ReplicaRow, why: str) -> None:
        """A running replica drains; one not running is cancelled at once."""
        if r.state == "active":
            plan.states.append((r.id, r.attempt, "draining"))
        else:
            plan.ends.append((r.id, r.attempt, "cancelled", why))

    @staticmethod
    def _drain(
        plan: _Plan,
        svc: store.ServiceRow,
        spec: ServiceSpec,
        r: store.ReplicaRow,
        per: dict[int, int],
        oldest_report: datetime | None,
        now: datetime,
    ) -> None:
        """Release a draining replica once the gateways say nothing is in flight on it — in reports
        written DRAIN_SETTLE_S after it began draining, when every gateway had stopped sending it
        requests — or once `drain_s` is over."""
        if svc.deleted_at is not None:
            why = "drained: service deleted"
        elif r.generation < svc.generation:
            why = f"replaced by generation {svc.generation}"
        else:
            why = "drained: scaled down"
        if r.state != "active":
            plan.ends.append((r.id, r.attempt, "cancelled", why))
            return
        since = r.since or now
        settled_at = since + timedelta(seconds=DRAIN_SETTLE_S)
        settled = now >= settled_at and (oldest_report is None or oldest_report > settled_at)
        if (settled and per.get(r.id, 0) == 0) or (now - since).total_seconds() >= spec.drain_s:
            plan.ends.append((r.id, r.attempt, "released", why))

    # --- writes -------------------------------------------------------------------------------
    def _commit(self, term: int, plan: _Plan, judged_at: datetime) -> PassReport:
        report = PassReport(leader=True)
        if not (plan.states or plan.ends or plan.starts or plan.decisions):
            return report
        nodes: set[str] = set()
        with self.db.write() as s:
            if not self.leadership.holds(s, term):
                return PassReport(leader=False)
            now = max(db_now(s), judged_at)  # a test's clock may run ahead of the database's
            for alloc_id, attempt, state in plan.states:
                head = alloc_store.lock_head(s, alloc_id)
                if head is None or head.attempt != attempt or head.state not in LIVE:
                    continue
                store.set_replica_state(s, alloc_id, state, now)
                if state == "ready":
                    report.ready.append(alloc_id)
                elif state == "draining":
                    report.draining.append(alloc_id)
            for alloc_id, attempt, ended_as, why in plan.ends:
                head = alloc_store.lock_head(s, alloc_id)
                if head is None or head.attempt != attempt or head.state not in LIVE:
                    continue
                alloc_store.end(s, head, ended_as, why, now)
                nodes.update(head.nodes)
                report.ended.append(alloc_id)
            for sid, count in plan.starts.items():
                report.started.extend(self._start(s, sid, count, now, plan))
            for sid, (desired, reason) in plan.decisions.items():
                store.set_decision(s, sid, desired, reason)
        for alloc_id, _, _, why in plan.ends:
            if alloc_id in report.ended:
                log.info("service replica %d: %s", alloc_id, why)
        if nodes:
            self.hub.notify(*topics.nodes(nodes))
        if report.ended:
            self.hub.notify(*topics.ended(report.ended))
        if report.started or report.ended:
            self.hub.wake_scheduler()
        return report

    def _start(self, s: Session, sid: int, count: int, now: datetime, plan: _Plan) -> list[int]:
        svc = store.by_ids(s, [sid]).get(sid)
        if svc is None or svc.deleted_at is not None:
            return []
        spec = ServiceSpec.model_validate(svc.spec)
        cap = self.settings.max_replicas_per_tenant
        live = store.live_replicas_of_tenant(s, svc.tenant_id)
        if live + count > cap:
            count = max(0, cap - live)
            self._note(
                plan,
                svc,
                f"replica not started: tenant '{svc.tenant}' has {live} live replicas, "
                f"its services may have {cap} (max_replicas_per_tenant)",
            )
            if count == 0:
                return []
        used = store.used_ports(s, now, PORT_COOLDOWN_S)
        lo, hi = self.settings.service_port_min, self.settings.service_port_max
        started: list[int] = []
        try:
            req = replica_request(spec, svc.tenant, request_defaults.of_tenant(s, self.settings, svc.tenant))
            images.pin(s, self.settings, svc.tenant, svc.tenant_id, req)  # as published now
            blob_service.claim(s, svc.tenant_id, req, now)  # the code archive must still be the tenant's
        except Invalid as e:
            self._note(plan, svc, f"replica not started: spec.request.{e.message}")
            return []
        squatted = self._squatted_ports(now)
        for _ in range(count):
            # held by another process lately: only when no port without that history is free
            port = self._free_port(used | squatted, lo, hi) or self._free_port(used, lo, hi)
            if port is None:
                self._note(plan, svc, f"replica not started: every service port {lo}-{hi} is taken")
                break
            used.add(port)
            started.append(store.insert_replica(s, svc, req, spec.port_env, port, now))
        return started

    def _free_port(self, used: set[int], lo: int, hi: int) -> int | None:
        """The first port not `used` after the one given last, wrapping around: a port just freed
        is the last to be given again."""
        start = self._next_port if self._next_port is not None and lo <= self._next_port <= hi else lo
        for port in itertools.chain(range(start, hi + 1), range(lo, start)):
            if port not in used:
                self._next_port = port + 1
                return port
        return None

    def _squatted_ports(self, now: datetime) -> set[int]:
        for p, at in list(self._squatted.items()):
            if (now - at).total_seconds() >= SQUATTED_AVOID_S:
                del self._squatted[p]
        return set(self._squatted)

    @staticmethod
    def _note(plan: _Plan, svc: store.ServiceRow, why: str) -> None:
        desired = plan.decisions.get(svc.id, (svc.desired, ""))[0]
        if (desired, why) != (svc.desired, svc.reason):
            plan.decisions[svc.id] = (desired, why)
        else:
            plan.decisions.pop(svc.id, None)

    # --- the loop -----------------------------------------------------------------------------
    def periodic(self) -> Periodic:
        return Periodic("services", PASS_EVERY_S, self.run_once, enabled=lambda: self.auto)


def _desired(spec: ServiceSpec, n: int, total: int, idle: bool) -> int:
    """Replicas for `total` requests in flight and queued, within the spec's bounds; a service
    with no load that is not idle long enough keeps one (nothing else would wake it)."""
    need = math.ceil(total / spec.target_inflight)
    floor = spec.min_replicas
    if spec.min_replicas == 0 and total == 0 and not idle:
        floor = min(n, 1)  # not idle long enough to go to zero (and nothing to wake it)
    return max(spec.min_replicas, min(spec.max_replicas, max(need, floor)))


def _with(r: store.ReplicaRow, replica_state: ReplicaState) -> store.ReplicaRow:
    return store.ReplicaRow(**{**r.__dict__, "replica_state": replica_state})


def _stderr_said(s: Session, alloc_id: int) -> str:
    """`; stderr: "…"` with the replica's last stderr lines, or nothing when it wrote none."""
    lines = log_store.last_lines(s, alloc_id, "stderr")
    return f'; stderr: "{" | ".join(lines)[-300:]}"' if lines else ""
