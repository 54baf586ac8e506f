"""The alert engine's pass: leader-only and fenced, leader changes, a broken audit chain, and a new
leader resolving what its predecessor fired (SQLite and PostgreSQL)."""

from __future__ import annotations

import time
from datetime import timedelta

from harness import Api
from sqlalchemy import update
from test_alerts import Passes, firing

from computepool.server.alerts import AlertEngine
from computepool.server.scheduling import Controller
from computepool.store.db import db_now
from computepool.store.models import AuditHead, SchedulerLease


def expire_lease(api: Api) -> None:
    """As if the leader had stopped renewing: its lease runs out."""
    with api.app.state.db.write() as s:
        past = db_now(s) - timedelta(seconds=60)
        s.execute(update(SchedulerLease).where(SchedulerLease.id == 1).values(expires_at=past))


def second_replica(api: Api, holder: str) -> tuple[Controller, AlertEngine]:
    state = api.app.state
    controller = Controller(state.db, state.settings, state.hub, holder=holder)
    engine = AlertEngine(
        state.db, state.settings, state.hub, controller.leadership, audit_problem=lambda: None
    )
    return controller, engine


def test_leader_changes_fire_once_and_resolve_and_the_old_leader_is_fenced_out(api: Api) -> None:
    p = Passes(api)
    assert p.run().leader is True and p.run().fired == []  # the first leader (term 1) is no change
    expire_lease(api)
    other, engine = second_replica(api, "replica-b")
    assert other.acquire() == 2
    rep = engine.run_once()
    assert rep.fired == [("leader-changed", "pool")]
    [alert] = firing(api, "leader-changed")
    assert alert["detail"] == {"term": 2, "previous_term": None} and "term 2" in alert["summary"]
    assert engine.run_once().fired == []  # once per change
    # the old leader still believes it leads (its lease is within its TTL here): its writes are fenced
    old: AlertEngine = api.app.state.alert_engine
    api.app.state.audit_problem = "made up"
    assert old.leadership.term == 1
    assert old.run_once().leader is False
    assert firing(api, "audit-chain-broken") == []
    # the change resolves after its window (10 min by default), and does not fire again
    with api.app.state.db.read() as s:
        later = db_now(s) + timedelta(seconds=601)
    assert engine.run_once(later).resolved == [("leader-changed", "pool")]
    assert engine.run_once(later + timedelta(seconds=5)).fired == []
    # a replica that is not the leader does nothing at all
    _, idle = second_replica(api, "replica-c")
    assert idle.run_once().leader is False
    # the next change: a new alert, naming the term before
    expire_lease(api)
    third, engine3 = second_replica(api, "replica-d")
    assert third.acquire() == 3
    assert engine3.run_once().fired == [("leader-changed", "pool")]
    [alert] = firing(api, "leader-changed")
    assert alert["detail"] == {"term": 3, "previous_term": 2}


def test_the_only_replica_restarting_is_no_leader_change(api: Api) -> None:
    """One server whose lease ran out (a restart) takes a new term: no leader-changed alert. The
    same engine with a second replica's URL live does fire it."""
    state = api.app.state
    assert state.replicas.urls() == [state.replicas.url]  # this replica alone publishes a URL
    p = Passes(api)
    assert p.run().leader is True and p.run().fired == []
    expire_lease(api)
    restarted, _ = second_replica(api, "same-server-restarted")  # a new process: a new holder
    assert restarted.acquire() == 2
    alone = AlertEngine(
        state.db, state.settings, state.hub, restarted.leadership, lambda: None,
        replica_count=lambda: len(state.replicas.urls()),
    )  # fmt: skip
    assert alone.run_once().fired == []
    assert firing(api, "leader-changed") == []
    # two replicas live: the next new term is a change
    expire_lease(api)
    other, _ = second_replica(api, "replica-b")
    assert other.acquire() == 3
    two = AlertEngine(
        state.db, state.settings, state.hub, other.leadership, lambda: None, replica_count=lambda: 2
    )
    assert two.run_once().fired == [("leader-changed", "pool")]


def test_a_new_leader_resolves_what_the_old_one_fired(make_api: object) -> None:
    # suspect after 30 s: the passes' clock (40 s ahead) decides, and the real one stays fresh
    api: Api = make_api(heartbeat_interval_s=0.2, suspect_after_s=30.0, lost_after_s=600.0)  # type: ignore[operator]
    from test_allocations import join

    p = Passes(api)
    join(api, "n1", devices=1)
    assert p.run(ahead_s=40).fired == [("node-suspect", "node/n1")]
    expire_lease(api)
    other, engine = second_replica(api, "replica-b")
    other.acquire()
    rep = engine.run_once()  # the node is fresh in real time: the new leader resolves the alert
    assert ("node-suspect", "node/n1") in rep.resolved and ("leader-changed", "pool") in rep.fired


def test_a_broken_audit_chain_fires_and_a_repaired_view_resolves(api: Api) -> None:
    p = Passes(api)
    api.tenant("t1")  # something audited
    assert p.run().fired == []
    # the head changed without the server's key: the server's watch notices within a second
    with api.app.state.db.write() as s:
        s.execute(update(AuditHead).where(AuditHead.id == 1).values(hash="0" * 64))
    deadline = time.monotonic() + 5
    while api.app.state.audit_problem is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert api.app.state.audit_problem is not None
    assert p.run().fired == [("audit-chain-broken", "pool")]
    [alert] = firing(api, "audit-chain-broken")
    assert alert["severity"] == "critical" and "head signature" in alert["summary"]
    assert alert["tenant"] is None
    # a unit view of the same rule: the engine asks its callable each pass
    problem: list[str | None] = ["records cut from the end"]
    state = api.app.state
    engine = AlertEngine(
        state.db, state.settings, state.hub, state.leadership, audit_problem=lambda: problem[0]
    )
    assert engine.run_once().fired == []  # already firing: never a second alert
    problem[0] = None
    assert engine.run_once().resolved == [("audit-chain-broken", "pool")]


def test_the_leader_prunes_resolved_alerts_and_finished_deliveries_past_keeping(make_api: object) -> None:
    from test_alerts import alerts, beat
    from test_alerts_notify import SICK, WELL, Receiver
    from test_allocations import join

    from computepool.store import alerts as store

    api: Api = make_api(history_keep_s=3600.0)  # type: ignore[operator]
    receiver = Receiver()
    try:
        p = Passes(api)
        notifier = p.engine.notifier
        api.ok("POST", "/api/v1/webhooks", json={"url": receiver.url})
        node = join(api, "n1", devices=2)
        beat(api, "n1", node, {0: SICK, 1: WELL})
        assert p.run().pruned == (0, 0)  # the first pass looks: nothing old yet
        notifier.run_once()
        beat(api, "n1", node, {0: WELL, 1: SICK})
        rep = p.run()
        assert rep.resolved == [("device-unhealthy", "device/n1/0")]
        assert rep.fired == [("device-unhealthy", "device/n1/1")]
        assert [o.ok for o in notifier.run_once()] == [True, True]
        [old] = [a for a in alerts(api) if a["subject"] == "device/n1/0"]
        # an hour and more on: the resolved alert goes, and the three sent deliveries (its two and the
        # firing one's); the firing alert stays, and what is still to be sent
        later = p.run(ahead_s=3700)
        assert later.pruned == (1, 3)
        assert later.fired == [("node-lost", "node/n1")]  # silent since: its delivery is pending
        left = alerts(api)
        assert old["id"] not in [a["id"] for a in left]
        assert ("device-unhealthy", "device/n1/1", "firing") in {
            (a["rule"], a["subject"], a["state"]) for a in left
        }
        with api.app.state.db.read() as s:
            assert [(d.state, d.alert_id) for d in store.deliveries(s)] == [
                ("pending", a["id"]) for a in left if a["rule"] == "node-lost"
            ]
        assert p.run(ahead_s=3800).pruned == (0, 0)  # not again within ten minutes
    finally:
        receiver.close()
