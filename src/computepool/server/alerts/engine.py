"""The rule pass: on the scheduling leader, every `alerts_interval_s`, run the rules, fire what has
held long enough, resolve what cleared, and queue the notifications.

The first time a condition held is kept in memory per (rule, subject): a new leader starts the
clocks afresh (it may fire later, never earlier). Which alerts fire is read from the database, so
a new leader resolves what its predecessor fired; writes are fenced by the lease term like the
scheduler's, and there is never a second firing alert for one (rule, subject). The leader also
drops resolved alerts and finished deliveries older than `history_keep_s`, so neither table grows
without end.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from computepool.server import topics
from computepool.server.alerts import rules
from computepool.server.alerts.notify import Notifier
from computepool.server.alerts.rules import Facts, Finding, Rule
from computepool.server.hub import Hub
from computepool.server.leadership import Leadership
from computepool.server.loops import Periodic
from computepool.server.scheduling.snapshot import SnapshotCache
from computepool.server.settings import ServerSettings
from computepool.store import alerts as store
from computepool.store.alerts import RuleSetting
from computepool.store.db import Database, db_now
from computepool.store.models import Alert

log = logging.getLogger("computepool.server")
# allocation events re-read below the last one read: ids a concurrent transaction took earlier but
# committed later (PostgreSQL sequences) are still seen
EVENT_MARGIN = 1000
PRUNE_EVERY_S = 600.0  # how often the leader deletes what is past `history_keep_s`


def effective(settings: ServerSettings, stored: dict[str, RuleSetting]) -> dict[str, RuleSetting]:
    """Every rule's setting: the operator's where one is stored, else the rule's defaults."""
    return {r.name: stored.get(r.name) or r.default(settings) for r in rules.RULES}


@dataclass
class AlertReport:
    leader: bool
    fired: list[tuple[str, str]] = field(default_factory=list)
    resolved: list[tuple[str, str]] = field(default_factory=list)
    pruned: tuple[int, int] = (0, 0)  # (alerts, deliveries) deleted as past history_keep_s


@dataclass(frozen=True)
class _Firing:
    id: int
    summary: str


class AlertEngine:
    """Evaluates the rules every `alerts_interval_s` on the leader and delivers notifications.

    `audit_problem` tells what is wrong with the audit chain as this replica last checked it."""

    def __init__(
        self,
        db: Database,
        settings: ServerSettings,
        hub: Hub,
        leadership: Leadership,
        audit_problem: Callable[[], str | None],
        replica_count: Callable[[], int] | None = None,
    ) -> None:
        self.db, self.settings, self.hub, self.leadership = db, settings, hub, leadership
        self.audit_problem = audit_problem
        # how many replicas publish a live URL (None: unknown); with exactly one, a new term is
        # that one server restarted, not a change of leader worth an alert
        self.replica_count = replica_count
        self.notifier = Notifier(db, settings)
        self.auto = True
        self._since: dict[tuple[str, str], datetime] = {}
        # the term led in: since when, the term the last leader-changed alert named then, and
        # whether this term is a change from it
        self._term_seen: tuple[int, datetime, int | None, bool] | None = None
        # failed ends seen so far in the look-back, and the last allocation event read
        self._ends: list[store.EndSeen] = []
        self._last_event = 0
        self._pruned_at: datetime | None = None
        self._lock = threading.Lock()
        self._snapshots = SnapshotCache()  # each pass reads only the live work that changed

    # --- one pass -----------------------------------------------------------------------------------

    def run_once(self, now: datetime | None = None) -> AlertReport:
        """One pass of every enabled rule (`now`: the time to judge by; tests move it ahead)."""
        with self._lock:
            term = self.leadership.term
            if term is None:
                self._since.clear()
                self._term_seen = None
                self._ends, self._last_event = [], 0
                self._pruned_at = None
                return AlertReport(leader=False)
            facts, setting, firing = self._read(term, now)
            found: dict[tuple[str, str], tuple[Rule, Finding]] = {}
            for rule in rules.RULES:
                rs = setting[rule.name]
                if not rs.enabled:
                    continue
                for f in rule.check(facts, rs):
                    found[(rule.name, f.subject)] = (rule, f)
            for gone in set(self._since) - set(found):
                del self._since[gone]
            fire: list[tuple[Rule, Finding]] = []
            update: list[tuple[int, Finding]] = []
            for key, (rule, f) in found.items():
                first = self._since.setdefault(key, facts.now)
                held_s = (facts.now - first).total_seconds()
                was = firing.get(key)
                if was is not None:
                    if was.summary != f.summary[:1024]:
                        update.append((was.id, f))
                elif held_s >= setting[rule.name].duration_s:
                    fire.append((rule, f))
            resolve = [(key, a.id) for key, a in firing.items() if key not in found]
            report = AlertReport(leader=True)
            if fire or resolve or update:
                report = self._commit(term, facts.now, fire, resolve, update)
            if report.leader:
                report.pruned = self._prune(term, facts.now)
            return report

    def _prune(self, term: int, now: datetime) -> tuple[int, int]:
        """Every PRUNE_EVERY_S (of `now`), delete what is older than `history_keep_s`; fenced."""
        if self._pruned_at is not None and (now - self._pruned_at).total_seconds() < PRUNE_EVERY_S:
            return (0, 0)
        with self.db.write() as s:
            if not self.leadership.holds(s, term):
                return (0, 0)
            pruned = store.prune(s, now - timedelta(seconds=self.settings.history_keep_s))
        self._pruned_at = now
        if pruned != (0, 0):
            log.info("alerts: deleted %d resolved alerts and %d finished deliveries past keeping", *pruned)
        return pruned

    def _read(
        self, term: int, now: datetime | None
    ) -> tuple[Facts, dict[str, RuleSetting], dict[tuple[str, str], _Firing]]:
        with self.db.read() as s:
            at = now or db_now(s)
            if self._term_seen is None or self._term_seen[0] != term:
                before = store.lease_term_seen(s)
                changed = before != term and not (before is None and term <= 1)
                if changed and self.replica_count is not None and self.replica_count() == 1:
                    log.info("alerts: term %d is the only replica's restart, not a leader change", term)
                    changed = False
                self._term_seen = (term, at, before, changed)
            setting = effective(self.settings, store.rule_settings(s))
            look_back = max(rules.JOB_FAILING_WINDOW_S, setting["slice-memory-killed"].threshold)
            wants_snapshot = setting["fragmentation"].enabled or setting["tenant-at-limit"].enabled
            lost = setting["node-lost"]
            window_start = at - timedelta(seconds=look_back)
            fresh, last = store.ends_after(s, max(0, self._last_event - EVENT_MARGIN), window_start)
            known = {e.event_id for e in self._ends}
            kept = [e for e in self._ends if e.at >= window_start]
            self._ends = kept + [e for e in fresh if e.event_id not in known]
            self._last_event = max(self._last_event, last)
            facts = Facts(
                now=at,
                nodes=store.nodes(s),
                devices=store.devices(s),
                held=store.held(s),
                ends=[e for e in self._ends if e.at <= at],
                snapshot=self._snapshots.load(s, self.settings) if wants_snapshot else None,
                term=term,
                term_before=self._term_seen[2],
                term_changed=self._term_seen[3],
                term_first_seen=self._term_seen[1],
                audit_problem=self.audit_problem(),
                settings=self.settings,
                lost_after_s=lost.threshold if lost.enabled else None,
                observed_since=self.leadership.since,
            )
            firing = {k: _Firing(a.id, a.summary) for k, a in store.firing(s).items()}
        return facts, setting, firing

    def _commit(
        self,
        term: int,
        now: datetime,
        fire: list[tuple[Rule, Finding]],
        resolve: list[tuple[tuple[str, str], int]],
        update: list[tuple[int, Finding]],
    ) -> AlertReport:
        report = AlertReport(leader=True)
        mail = bool(self.settings.smtp_host and self.settings.mail_to)
        with self.db.write() as s:
            if not self.leadership.holds(s, term):
                return AlertReport(leader=False)
            hooks = [h.id for h in store.webhooks(s)]
            firing = store.firing(s)  # again, inside the fenced transaction
            for key, alert_id in resolve:
                a = s.get(Alert, alert_id)
                if a is None or a.state != "firing":
                    continue
                a.state, a.resolved_at = "resolved", now
                store.enqueue(s, a.id, "resolved", hooks, mail, now)
                report.resolved.append(key)
            for alert_id, f in update:
                a = s.get(Alert, alert_id)
                if a is not None and a.state == "firing":
                    a.summary, a.detail = f.summary[:1024], f.detail
            for rule, f in fire:
                if (rule.name, f.subject) in firing:
                    continue
                a = store.fire(s, rule.name, f.subject, f.tenant, rule.severity, f.summary, f.detail, now)
                store.enqueue(s, a.id, "firing", hooks, mail, now)
                report.fired.append((rule.name, f.subject))
        for rule_name, subject in report.fired:
            log.warning("alert firing: %s %s", rule_name, subject)
        for rule_name, subject in report.resolved:
            log.info("alert resolved: %s %s", rule_name, subject)
        if report.fired or report.resolved:
            self.hub.notify(topics.ALERTS)
            self.notifier.wake()
        return report

    # --- the loops ----------------------------------------------------------------------------------

    def periodic(self) -> list[Periodic]:
        """The rules' passes, and the notifier's delivery rounds."""
        every = self.settings.alerts_interval_s
        return [Periodic("alerts", every, self.run_once, enabled=lambda: self.auto), self.notifier.periodic()]

    def start(self) -> None:
        _ = self.notifier.key  # the webhook key made (0600) at start, not on the first webhook
        self.notifier.start()

    async def stop(self) -> None:
        await self.notifier.stop()
