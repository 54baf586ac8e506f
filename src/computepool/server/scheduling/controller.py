"""The scheduling loop of one server process: lease → snapshot → decide → fenced commit.

Nodes are judged lost by what this leader has observed: silence counts from the later of a
node's last heartbeat and the moment this replica last began to lead with a working database
(`Leadership.since`), never from rows that aged while the database or the control plane was away.
When more than `lost_brake_share` of the nodes are silent together, the silence is more likely
the control plane's (its network, its database) than theirs: no node is declared lost until
enough report again (Kubernetes' node-lifecycle disruption mode), said once in the log, and on
/metrics and by the `nodes-silent` alert rule.

Wake-ups are gathered: those during a cycle are one more cycle (`loops.Periodic`), and a cycle
starts no sooner than `settle_s` after the last one ended, so a burst of submissions and agent
reports is decided together while a lone submission is placed at once. A cycle whose snapshot
equals the last decided one's, with no wake-up since, decides nothing anew (decisions are a
function of the snapshot): a queue that cannot move costs a few reads a second, not a decision
and a commit. Time alone changes a few things a snapshot does not show (a reservation's shadow
time), so such a snapshot is still decided again every `refresh_s`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.exc import DBAPIError

from computepool.server import topics
from computepool.server.hub import Hub
from computepool.server.leadership import LEASE_TTL_S, Leadership
from computepool.server.loops import Periodic
from computepool.server.scheduling.commit import CommitResult, LostLease, commit
from computepool.server.scheduling.decide import decide
from computepool.server.scheduling.snapshot import Snapshot, SnapshotCache
from computepool.server.settings import ServerSettings
from computepool.store import allocations as store
from computepool.store.db import Database, db_now

log = logging.getLogger("computepool.server")

CYCLE_INTERVAL_S = 1.0
SETTLE_S = 0.02  # the least time between the end of a cycle and the start of the next one woken
REFRESH_S = 5.0  # an unchanged snapshot is decided again this often all the same
STANDBY_POLL_S = 0.25  # how often a standby tries the leader's advisory lock (PostgreSQL)


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
    skipped: bool = False  # the snapshot equals the last decided one: nothing decided anew


@dataclass(frozen=True)
class _Basis:
    """What a cycle decided from: the same basis, with no wake-up since, gives the same decisions."""

    term: int
    wakes: int
    nodes: list[Any]
    weights: dict[str, float]
    quotas: dict[str, Any]
    live: tuple[tuple[int, str, int, str], ...]
    braked: bool

    @staticmethod
    def of(term: int, wakes: int, snap: Snapshot) -> _Basis:
        live = tuple((a.id, a.state, a.attempt, a.reason) for a in snap.live)
        return _Basis(term, wakes, snap.nodes, snap.weights, snap.quotas, live, snap.braked)


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
        leadership: Leadership | None = None,
        settle_s: float = SETTLE_S,
        refresh_s: float = REFRESH_S,
    ) -> None:
        self.db = db
        self.settings = settings
        self.hub = hub
        self.observe = observe
        self.interval_s = interval_s
        self.settle_s = settle_s  # read at each wake-up (tests widen it)
        self._ended = float("-inf")  # when the last cycle ended (time.monotonic)
        self.refresh_s = refresh_s
        self.leadership = leadership or Leadership(db, ttl_s=lease_ttl_s, holder=holder)
        self.auto = True  # tests turn the background loop off and call run_once
        self._lock = threading.Lock()
        self._snapshots = SnapshotCache()
        self._periodic: Periodic | None = None
        self.braked = False  # whether the last cycle held back lost-node decisions
        self._decided: tuple[_Basis, float] | None = None  # the last decided basis, and when

    @property
    def holder(self) -> str:
        return self.leadership.holder

    def acquire(self) -> int | None:
        """Take or renew the lease now (tests, and a replica that must lead at once)."""
        return self.leadership.acquire()

    @property
    def leader(self) -> bool:
        return self.leadership.leader

    @property
    def term(self) -> int | None:
        return self.leadership.term

    def _lost_before(self, now: datetime) -> datetime:
        """Heartbeats before this may mean lost. Until this leader has watched for lost_after_s no
        node is lost; a node silent for long before then costs a cycle that decides nothing."""
        lost_after = timedelta(seconds=self.settings.lost_after_s)
        since = self.leadership.since or now
        return now - lost_after if since <= now - lost_after else since - lost_after

    def run_once(self) -> CycleReport:
        """One cycle (thread-safe; cycles of one process never overlap)."""
        with self._lock:
            try:
                return self._cycle()
            except DBAPIError:
                self.leadership.lost()  # what this leader observes counts again from its next renewal
                raise
            finally:
                self._ended = time.monotonic()

    def _cycle(self) -> CycleReport:
        t0 = time.perf_counter()
        wakes = self.hub.wakes  # read first: a wake-up from here on is seen by the next cycle
        term = self.leadership.renewed_term()
        if term is None:
            return CycleReport(leader=False)
        with self.db.read() as s:
            if not store.needs_cycle(s, self._lost_before(db_now(s))):  # idle: nothing pending, no node lost
                return CycleReport(True, term, time.perf_counter() - t0, 0.0, 0, CommitResult())
            snap = self._snapshots.load(s, self.settings, observed_since=self.leadership.since)
        self._set_brake(snap.braked, snap.silent, len(snap.nodes))
        pending = sum(1 for a in snap.live if a.state == "pending")
        basis = _Basis.of(term, wakes, snap)
        if self._unchanged(basis):
            t1 = time.perf_counter()
            return CycleReport(True, term, t1 - t0, 0.0, pending, CommitResult(), t1 - t0, skipped=True)
        t1 = time.perf_counter()
        plan = decide(snap)
        t2 = time.perf_counter()
        try:
            ports = (self.settings.gang_port_min, self.settings.gang_port_max)
            result = commit(self.db, plan, self.holder, term, gang_ports=ports)
        except LostLease:
            self._decided = None
            self.leadership.lost()
            if self.leadership.acquire() != term:  # another replica schedules now
                return CycleReport(leader=False)
            raise
        t3 = time.perf_counter()
        elapsed = t3 - t0
        if self.observe is not None:
            self.observe(elapsed)
        self.hub.notify(*topics.nodes(result.nodes), *topics.ended(result.stopped))
        self.hub.notify(*topics.allocs(result.bound))
        if result.requeued or result.unstarted:  # moved work waits; others may wait for what ended
            self.hub.wake_scheduler()
        fresh_for = self.refresh_s if plan.recheck_s is None else min(self.refresh_s, plan.recheck_s)
        self._decided = (basis, time.monotonic() + fresh_for - self.refresh_s)  # a back-off ends sooner
        return CycleReport(True, term, elapsed, t2 - t1, pending, result, t1 - t0, t3 - t2)

    def _settle(self) -> float:
        """How long a wake-up waits for more: what is left of `settle_s` since the last cycle ended
        (nothing after a quiet spell: a lone submission is placed at once)."""
        return max(0.0, self._ended + self.settle_s - time.monotonic())

    def _unchanged(self, basis: _Basis) -> bool:
        """Whether the last decided basis is this one, and recent enough to stand for it."""
        last = self._decided
        return last is not None and last[0] == basis and time.monotonic() - last[1] < self.refresh_s

    def _set_brake(self, braked: bool, silent: int, total: int) -> None:
        """Say once when the brake engages and once when it lets go."""
        if braked and not self.braked:
            log.warning(
                "scheduling: %d of %d nodes are silent together (more than lost_brake_share %g): "
                "declaring no node lost until more of them report",
                silent,
                total,
                self.settings.lost_brake_share,
            )
        elif self.braked and not braked:
            log.warning("scheduling: enough nodes report again: lost nodes are declared as usual")
        self.braked = braked

    def periodic(self) -> Periodic:
        """A cycle when `Hub.wake_scheduler` says something changed, else every interval; a
        standby on PostgreSQL tries the leader's lock every STANDBY_POLL_S instead."""
        self._periodic = Periodic(
            "scheduler",
            self.interval_s,
            self._step,
            wake=lambda: self.hub.scheduler_event,
            enabled=lambda: self.auto,
            settle=self._settle,
        )
        return self._periodic

    def _step(self) -> None:
        try:
            self.run_once()
        except LostLease as e:
            log.info("scheduling: %s", e)
        finally:
            if self._periodic is not None:
                fast = self.leadership.fast and not self.leader
                self._periodic.every_s = STANDBY_POLL_S if fast else self.interval_s
