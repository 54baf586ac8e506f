"""`cpool nodes` and /metrics judge a node's state as the scheduler does, on every replica: silence
counted from no earlier than the leader began to watch with a working database (the lease says
when), and no node lost while the brake holds. A stored heartbeat's age alone would call every
node lost right after a database outage that the scheduler, rightly, declares nothing lost for."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from harness import Api
from sqlalchemy import update
from test_allocations import cycle, join, manual

from computepool.server.scheduling import SnapshotCache
from computepool.store.db import db_now
from computepool.store.models import Node

SLOW = {"heartbeat_interval_s": 5.0, "suspect_after_s": 50.0, "lost_after_s": 100.0}
NODES = ("n1", "n2", "n3", "n4")


def _age(api: Api, seconds: float, *names: str) -> None:
    """The nodes' stored heartbeats `seconds` old, as when none got through an outage."""
    with api.app.state.db.write() as s:
        s.execute(
            update(Node)
            .where(Node.name.in_(names or NODES))
            .values(last_heartbeat_at=db_now(s) - timedelta(seconds=seconds))
        )


def _states(api: Api) -> dict[str, str]:
    return {n["name"]: n["state"] for n in api.ok("GET", "/api/v1/nodes")["items"]}


def _metric_states(api: Api) -> dict[str, str]:
    out = {}
    for line in api.get("/metrics", headers=api.admin).text.splitlines():
        if line.startswith("cpool_node_state{") and line.endswith(" 1.0"):
            labels = dict(
                p.split("=", 1) for p in line[len("cpool_node_state{") : line.index("}")].split(",")
            )
            out[labels["node"].strip('"')] = labels["state"].strip('"')
    return out


def _scheduler_states(api: Api) -> dict[str, str]:
    with api.app.state.db.read() as s:  # what the scheduling cycle reads
        since = api.app.state.leadership.since
        return {n.name: n.state for n in SnapshotCache().load(s, api.settings, observed_since=since).nodes}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_every_replica_judges_nodes_as_the_leader_does(make_api: Any) -> None:
    leader: Api = make_api(**SLOW)
    manual(leader)
    for name in NODES:
        join(leader, name, devices=1)
    assert cycle(leader).leader
    standby: Api = make_api(**SLOW)  # a second replica on the same database, never leading
    manual(standby)
    leader.app.state.leadership.lost()  # the database failed the leader ...
    _age(leader, 300)  # ... for longer than lost_after_s: no heartbeat got through
    assert leader.app.state.leadership.acquire() is not None  # back: it watches afresh
    assert cycle(leader).leader
    ready = dict.fromkeys(NODES, "ready")
    assert _scheduler_states(leader) == ready
    for api in (leader, standby):  # stored ages alone would say "lost" for all four
        assert _states(api) == ready
        assert api.ok("GET", "/api/v1/nodes/n4")["state"] == "ready"
        assert _metric_states(api) == ready
    # the leader has now watched for 120 s: n4 alone stayed silent, an ordinary node loss
    with leader.app.state.db.read() as s:
        leader.app.state.leadership.observed_since(db_now(s) - timedelta(seconds=120))
    _age(leader, 1, "n1", "n2", "n3")
    one_lost = ready | {"n4": "lost"}
    assert _scheduler_states(leader) == one_lost
    for api in (leader, standby):
        assert _states(api) == one_lost and _metric_states(api) == one_lost
    # three of four silent that long: the brake holds, and no replica calls any of them lost
    _age(leader, 120, "n2", "n3")
    braked = {"n1": "ready", "n2": "suspect", "n3": "suspect", "n4": "suspect"}
    assert _scheduler_states(leader) == braked
    for api in (leader, standby):
        assert _states(api) == braked and _metric_states(api) == braked


def test_a_pool_no_leader_has_watched_judges_by_heartbeats(api: Api) -> None:
    manual(api)
    for name in NODES:
        join(api, name, devices=1)
    _age(api, 120, "n4")  # no lease yet: the stored age is all there is
    assert _states(api) == dict.fromkeys(NODES, "ready") | {"n4": "lost"}
