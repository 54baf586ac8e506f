"""Time limits: the control plane ends allocations bound longer than their `time_limit`, with a
clear event, an audit record, and the job dropped from its node's assignments (SQLite and PostgreSQL)."""

from __future__ import annotations

import time
from datetime import datetime, timedelta

from harness import Api
from test_allocations import alloc, cycle, explain, get, join, manual

from computepool.server.hub import Hub
from computepool.server.reclaim import Reclaimer, ReclaimReport
from computepool.server.scheduling import Controller


class Passes:
    """The app's reclaim controller, run by hand; each pass renews this replica's scheduling lease
    first, as the (here stopped) scheduling loop would."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.reclaimer: Reclaimer = api.app.state.reclaimer
        self.reclaimer.auto = False

    def run_once(self, now: datetime | None = None) -> ReclaimReport:
        self.api.app.state.controller.acquire()
        return self.reclaimer.run_once(now)


def reclaimer(api: Api) -> Passes:
    return Passes(api)


def test_a_time_limit_ends_the_allocation_with_a_clear_reason_even_when_restartable(api: Api) -> None:
    manual(api)
    rec = reclaimer(api)
    node = join(api, "n1", devices=3)
    job = alloc(api, gpus=1, command=["sleep", "600"], restartable=True, time_limit="2s")
    plain = alloc(api, gpus=1, time_limit="1h")
    forever = alloc(api, gpus=1, command=["sleep", "600"])
    assert job["request"]["time_limit"] == 2 and plain["request"]["time_limit"] == 3600
    cycle(api)
    assert {get(api, a["id"])["state"] for a in (job, plain, forever)} == {"bound"}
    summary = explain(api, plain["id"])["summary"]
    assert "time limit 1h: " in summary and "left" in summary, summary
    assert "time limit" not in explain(api, forever["id"])["summary"]
    bound_at = get(api, job["id"])["bound_at"]
    bound = datetime.fromisoformat(bound_at)  # the passes' clock, not the wall's: a busy host may be slow
    assert rec.run_once(bound + timedelta(seconds=1.5)).ended == []  # not yet
    assert get(api, job["id"])["state"] == "bound"
    report = rec.run_once(bound + timedelta(seconds=2.2))
    assert report.leader and report.ended == [job["id"]]
    ended = get(api, job["id"])
    assert ended["state"] == "failed" and ended["reason"] == "time limit 2s reached"
    assert ended["attempt"] == 1, "a limit is a limit: restartable work is not requeued"
    assert ended["ended_at"] is not None and ended["bound_at"] == bound_at
    assert ended["events"][-1]["reason"] == "time limit 2s reached"
    assert [get(api, a["id"])["state"] for a in (plain, forever)] == ["bound", "bound"]
    assert explain(api, job["id"])["summary"] == "failed: time limit 2s reached"
    # the job leaves its node's assignments: the agent stops it on the normal cancel path
    work = api.ok("GET", "/api/v1/nodes/n1/assignments", headers=node)["assignments"]
    assert [w["allocation_id"] for w in work] == [forever["id"]]
    records = api.ok("GET", "/api/v1/audit", params={"action": "allocation.time-limit"})["items"]
    assert [r["target"] for r in records] == [f"allocation:{job['id']}"]
    assert records[0]["actor"] == "scheduler" and records[0]["detail"]["reason"] == "time limit 2s reached"
    assert rec.run_once().ended == []  # ended once


def test_only_the_lease_holder_applies_time_limits(api: Api) -> None:
    manual(api)
    reclaimer(api)
    join(api, "n1")
    job = alloc(api, gpus=1, time_limit=1)
    cycle(api)  # this replica's controller holds the lease
    time.sleep(1.1)
    other = Controller(api.app.state.db, api.settings, Hub(), holder="another-replica")
    report = Reclaimer(api.app.state.db, api.settings, Hub(), other.leadership).run_once()
    assert not report.leader and report.ended == []
    assert get(api, job["id"])["state"] == "bound"
    api.app.state.controller.acquire()
    assert api.app.state.reclaimer.run_once().ended == [job["id"]]


def test_bad_time_limits_are_refused_naming_the_field(api: Api) -> None:
    join(api, "n1")
    for bad in ("soon", "0s", -5, "2y", True):
        r = api.post("/api/v1/allocations", json={"gpus": 1, "time_limit": bad}, headers=api.admin)
        assert r.status_code == 422, (bad, r.text)
        assert "time_limit" in r.text
