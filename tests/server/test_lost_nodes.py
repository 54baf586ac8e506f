"""Failure detection with a brake: no new work on a node that missed two heartbeats; silence is
counted from what this leader has observed (never from rows that aged while the database was
away); and when more than `lost_brake_share` of the nodes are silent together, none is lost."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from harness import Api, PgServer, heartbeat_ago
from sqlalchemy import update
from sqlalchemy.exc import OperationalError
from test_alerts import Passes, firing
from test_allocations import alloc, cycle, get, join, manual
from test_allocations_agent import report

from computepool.store.db import db_now
from computepool.store.models import Node

SLOW = {"heartbeat_interval_s": 5.0, "suspect_after_s": 50.0, "lost_after_s": 100.0}


def _beat(api: Api, node: str, headers: dict[str, str]) -> None:
    api.ok("POST", f"/api/v1/nodes/{node}/heartbeat", headers=headers, json={})


def _running_job(api: Api, node: str, headers: dict[str, str], **body: Any) -> dict[str, Any]:
    job = alloc(api, gpus=1, command=["sleep", "1000"], **body)
    _beat(api, node, headers)
    cycle(api)
    got = get(api, job["id"])
    assert got["state"] == "bound" and got["nodes"] == [node], got
    report(api, node, headers, {"allocation_id": job["id"], "attempt": 1, "state": "running"})
    assert get(api, job["id"])["state"] == "active"
    return job


def _age_rows(api: Api, seconds: float) -> None:
    """Every node's stored heartbeat `seconds` old, as after an outage (the leader saw none of it)."""
    with api.app.state.db.write() as s:
        s.execute(update(Node).values(last_heartbeat_at=db_now(s) - timedelta(seconds=seconds)))


def test_no_new_work_on_a_node_that_missed_two_heartbeats(make_api: Any) -> None:
    api: Api = make_api(**SLOW)
    manual(api)
    n1 = join(api, "n1", devices=1)
    heartbeat_ago(api, "n1", 11)  # two intervals and a bit: still "ready" (suspect at 50 s)
    assert api.ok("GET", "/api/v1/nodes/n1")["state"] == "ready"
    job = alloc(api, gpus=1, command=["sleep", "1"])
    cycle(api)
    assert get(api, job["id"])["state"] == "pending"
    _beat(api, "n1", n1)  # heard from again: placed
    cycle(api)
    assert get(api, job["id"])["state"] == "bound"


def test_stored_heartbeat_ages_alone_do_not_make_a_node_lost(make_api: Any) -> None:
    """A leader that has not watched for lost_after_s declares nothing lost, however old the rows."""
    api: Api = make_api(**SLOW)
    manual(api)
    n1 = join(api, "n1", devices=1)
    job = _running_job(api, "n1", n1)
    _age_rows(api, 300)
    cycle(api)
    assert get(api, job["id"])["state"] == "active"
    heartbeat_ago(api, "n1", 120)  # now the leader has watched it that long
    cycle(api)
    got = get(api, job["id"])
    assert (got["state"], got["reason"]) == ("failed", "node n1 lost")


@pytest.mark.parametrize("backend", ["postgresql"])
def test_a_database_outage_longer_than_lost_after_fails_no_healthy_job(
    make_api: Any, postgres: PgServer
) -> None:
    api: Api = make_api(**SLOW)
    manual(api)
    n1 = join(api, "n1", devices=1)
    job = _running_job(api, "n1", n1)
    heartbeat_ago(api, "n1", 1)  # the leader has watched the node for a while before the outage
    leadership = api.app.state.leadership
    watched_from = leadership.since
    postgres.stop("fast")
    try:
        with pytest.raises(OperationalError):
            cycle(api)
    finally:
        postgres.start()
    _age_rows(api, 300)  # the outage "lasted" longer than lost_after_s: no heartbeat got through
    deadline = time.monotonic() + 30
    while not cycle(api).leader:  # leading again once the lease is renewed
        assert time.monotonic() < deadline, "the replica did not lead again after the outage"
        time.sleep(0.2)
    assert get(api, job["id"])["state"] == "active"
    assert leadership.since > watched_from  # silence counts from the leader's return


def test_many_silent_nodes_at_once_engage_the_brake(make_api: Any) -> None:
    api: Api = make_api(**SLOW)
    manual(api)
    heads = {name: join(api, name, devices=1) for name in ("n1", "n2", "n3")}
    jobs = {name: _running_job(api, name, h, restartable=True) for name, h in heads.items()}
    for name in ("n1", "n2"):  # 2 of 3 silent: more than half
        heartbeat_ago(api, name, 120)
    cycle(api)
    assert {get(api, j["id"])["state"] for j in jobs.values()} == {"active"}
    assert api.app.state.controller.braked
    metrics = api.get("/metrics", headers=api.admin).text
    assert "cpool_node_lost_brake 1.0" in metrics and "cpool_nodes_silent 2.0" in metrics
    passes = Passes(api)
    assert passes.run().fired == []  # held for 30 s first: after an outage of its own, nodes report again
    assert passes.run(ahead_s=31).fired == [("nodes-silent", "pool")]
    [alert] = firing(api, "nodes-silent")
    assert "2 of 3 nodes silent" in alert["summary"]
    _beat(api, "n2", heads["n2"])  # 1 of 3 silent: an ordinary node failure
    cycle(api)
    assert not api.app.state.controller.braked
    moved = get(api, jobs["n1"]["id"])
    assert moved["attempt"] == 2 and "n1 lost" in moved["reason"]
    assert get(api, jobs["n2"]["id"])["state"] == "active"
    assert "cpool_node_lost_brake 0.0" in api.get("/metrics", headers=api.admin).text


def test_the_brake_share_is_a_setting(make_api: Any) -> None:
    api: Api = make_api(**SLOW, lost_brake_share=1.0)  # off
    manual(api)
    heads = {name: join(api, name, devices=1) for name in ("n1", "n2")}
    jobs = {name: _running_job(api, name, h, restartable=True) for name, h in heads.items()}
    for name in heads:
        heartbeat_ago(api, name, 120)
    cycle(api)
    assert not api.app.state.controller.braked
    assert {get(api, j["id"])["attempt"] for j in jobs.values()} == {2}
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="lost_brake_share"):
            make_api(**SLOW, lost_brake_share=bad)
