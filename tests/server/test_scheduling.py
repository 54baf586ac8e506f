"""The scheduling controller: quotas, borrowing and preemption, fair share, priority, fencing."""

from __future__ import annotations

from datetime import timedelta

from harness import Api
from sqlalchemy import update
from test_allocations import alloc, cycle, explain, get, join, manual

from computepool.server import scheduling
from computepool.server.hub import Hub
from computepool.server.scheduling import Controller, LostLease
from computepool.store.db import db_now
from computepool.store.models import SchedulerLease

Q = "/api/v1/tenants/{}/quota"


def quota(api: Api, tenant: str, guaranteed: int, limit: int) -> None:
    api.ok("PUT", Q.format(tenant), json={"gpu_milli": {"guaranteed": guaranteed, "limit": limit}})


def test_quota_limit_keeps_requests_pending(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=4)
    api.tenant("acme")
    alice = api.user("alice", "acme", "member")
    quota(api, "acme", 0, 1000)
    first = alloc(api, alice, gpus=1)
    second = alloc(api, alice, gpus=1)
    cycle(api)
    assert get(api, first["id"])["state"] == "bound"
    s = get(api, second["id"])
    assert s["state"] == "pending" and s["reason"] == "quota: GPU limit 1 (using 1, asks 1)"  # user units
    ex = explain(api, second["id"], alice)
    assert ex["summary"].startswith("quota") and ex["quota"]["gpu_milli"] == {
        "used": 1000,
        "request": 1000,
        "guaranteed": 0,
        "limit": 1000,
    }


def test_guarantee_preempts_borrowed_capacity_only(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=2)
    for t in ("owner", "borrower"):
        api.tenant(t)
    owner = api.user("olga", "owner", "member")
    borrower = api.user("bert", "borrower", "member")
    quota(api, "owner", 2000, 2000)
    quota(api, "borrower", 0, 2000)  # everything it holds is borrowed
    old = alloc(api, borrower, gpus=1, priority=5)  # higher priority: the last victim
    young = alloc(api, borrower, gpus=1, restartable=True)
    cycle(api)
    assert {get(api, x["id"])["state"] for x in (old, young)} == {"bound"}
    claim = alloc(api, owner, gpus=1)
    cycle(api)
    assert get(api, claim["id"])["state"] == "bound"
    y = get(api, young["id"])
    assert y["state"] == "pending" and y["attempt"] == 2, y  # restartable: requeued
    assert [e["state"] for e in y["events"]] == ["pending", "bound", "preempted", "pending"]
    assert "reclaimed by tenant owner" in y["events"][2]["reason"]
    assert get(api, old["id"])["state"] == "bound"  # only what was needed
    claim2 = alloc(api, owner, gpus=1)
    cycle(api)
    assert get(api, claim2["id"])["state"] == "bound"
    o = get(api, old["id"])
    assert o["state"] == "preempted" and "borrowed capacity reclaimed" in o["reason"] and o["ended_at"]
    # the owner is at its guarantee and limit; the requeued borrower waits
    assert get(api, young["id"])["state"] == "pending"
    actions = [x["action"] for x in api.ok("GET", "/api/v1/audit", params={"actor": "scheduler"})["items"]]
    assert actions.count("allocation.preempt") == 2 and actions.count("allocation.requeue") == 1


def test_guaranteed_capacity_is_never_taken(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=2)
    for t in ("a", "b"):
        api.tenant(t)
    ua = api.user("ua", "a", "member")
    ub = api.user("ub", "b", "member")
    quota(api, "a", 1000, 2000)
    quota(api, "b", 1000, 2000)
    b1 = alloc(api, ub, gpus=1)
    b2 = alloc(api, ub, gpus=1)  # borrowed (above b's guarantee of 1000)
    cycle(api)
    a1 = alloc(api, ua, gpus=1)
    a2 = alloc(api, ua, gpus=1)  # would be borrowing: may not preempt
    cycle(api)
    assert [get(api, x["id"])["state"] for x in (a1, a2)] == ["bound", "pending"]
    # exactly one of b's two is left: b keeps its guarantee
    assert sorted(get(api, x["id"])["state"] for x in (b1, b2)) == ["bound", "preempted"]


def test_weighted_fair_share_across_tenants(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=4)
    join(api, "n2", devices=4)
    api.tenant("light", weight=1)
    api.tenant("heavy", weight=3)
    light = api.user("l", "light", "member")
    heavy = api.user("h", "heavy", "member")
    mine = [alloc(api, light, gpus=1)["id"] for _ in range(8)]  # submitted first
    theirs = [alloc(api, heavy, gpus=1)["id"] for _ in range(8)]
    cycle(api)
    bound_light = sum(get(api, i)["state"] == "bound" for i in mine)
    bound_heavy = sum(get(api, i)["state"] == "bound" for i in theirs)
    assert (bound_light, bound_heavy) == (2, 6)
    # FIFO inside a tenant: the oldest of each were served
    assert [get(api, i)["state"] for i in mine[:3]] == ["bound", "bound", "pending"]


def test_priority_then_fifo_within_a_tenant(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=1)
    low = alloc(api, gpus=1)
    high = alloc(api, gpus=1, priority=10)
    cycle(api)
    assert (get(api, low["id"])["state"], get(api, high["id"])["state"]) == ("pending", "bound")
    assert explain(api, low["id"])["queue_position"] == 1


def test_cordoned_and_lost_nodes_take_no_work(api: Api) -> None:
    manual(api)
    join(api, "n1")
    api.ok("POST", "/api/v1/nodes/n1/cordon")
    a = alloc(api, gpus=1)
    cycle(api)
    assert get(api, a["id"])["state"] == "pending"
    assert explain(api, a["id"])["reasons"]["counts"] == {"not schedulable": 1}
    api.ok("POST", "/api/v1/nodes/n1/uncordon")
    cycle(api)
    assert get(api, a["id"])["state"] == "bound"


def test_term_fencing_rejects_an_old_leader(api: Api) -> None:
    manual(api)
    join(api, "n1")
    db, settings = api.app.state.db, api.settings
    old = Controller(db, settings, Hub(), holder="old-leader")
    new = Controller(db, settings, Hub(), holder="new-leader")
    a = alloc(api, gpus=1)
    t_old = old.acquire()
    assert t_old is not None and new.acquire() is None  # held: the other replica waits
    with db.read() as s:
        plan = scheduling.decide(scheduling.load_snapshot(s, settings))
    assert [b.id for b in plan.binds] == [a["id"]]
    with db.write() as s:  # the old leader stalls past its lease
        s.execute(update(SchedulerLease).values(expires_at=db_now(s) - timedelta(seconds=1)))
    t_new = new.acquire()
    assert t_new == t_old + 1
    try:
        scheduling.commit(db, plan, "old-leader", t_old)
        raise AssertionError("a commit from an old term went through")
    except LostLease:
        pass
    assert get(api, a["id"])["state"] == "pending"
    assert not old.run_once().leader
    rep = new.run_once()
    assert rep.leader and rep.term == t_new
    assert get(api, a["id"])["term"] == t_new


def test_decisions_are_a_function_of_the_snapshot(api: Api) -> None:
    manual(api)
    for n in ("n1", "n2", "n3"):
        join(api, n, devices=4)
    for i in range(20):
        alloc(api, gpus=1 + i % 3, gpu_milli=1000) if i % 2 else alloc(api, gpus=1, gpu_milli=250 + 25 * i)
    db, settings = api.app.state.db, api.settings
    with db.read() as s:
        snap = scheduling.load_snapshot(s, settings)
    first, second = scheduling.decide(snap), scheduling.decide(snap)
    assert first == second and first.binds


def test_drain_moves_restartable_work_and_lets_the_rest_finish(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=2)
    job = {"command": ["sleep", "60"], "gpus": 1}
    mobile = alloc(api, restartable=True, **job)
    fixed = alloc(api, **job)
    cycle(api)
    assert get(api, mobile["id"])["nodes"] == ["n1"] and get(api, fixed["id"])["nodes"] == ["n1"]
    join(api, "n2", devices=2)
    api.ok("POST", "/api/v1/nodes/n1/drain")
    rep = cycle(api)
    assert rep.result.requeued == [mobile["id"]]
    moved = get(api, mobile["id"])
    assert moved["state"] == "pending" and moved["attempt"] == 2 and "node n1 drained" in moved["reason"]
    assert get(api, fixed["id"])["state"] == "bound"  # cannot restart: finishes where it runs
    cycle(api)
    again = get(api, mobile["id"])
    assert again["state"] == "bound" and again["nodes"] == ["n2"]
    assert not cycle(api).result.requeued  # nothing left to move: the next cycles are quiet
