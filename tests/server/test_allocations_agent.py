"""The node agent's protocol: assignments long-poll, reports, stale attempts, logs, node loss."""

from __future__ import annotations

import threading
import time
from typing import Any

from harness import Api, heartbeat_ago
from test_allocations import A, alloc, cycle, get, join, manual


def assignments(api: Api, node: str, headers: dict[str, str], **params: Any) -> dict[str, Any]:
    return dict(api.ok("GET", f"/api/v1/nodes/{node}/assignments", headers=headers, params=params))


def report(api: Api, node: str, headers: dict[str, str], *reports: dict[str, Any]) -> dict[str, Any]:
    return dict(
        api.ok("POST", f"/api/v1/nodes/{node}/reports", headers=headers, json={"reports": list(reports)})
    )


def test_assignments_long_poll_and_reports(api: Api) -> None:
    manual(api)
    n1 = join(api, "n1", devices=2)
    n2 = join(api, "n2", devices=1, model="T4")
    empty = assignments(api, "n1", n1)
    assert empty["assignments"] == [] and empty["term"] == 0
    job = alloc(
        api, gpus=1, models=["A100"], command=["python", "train.py"], env={"EPOCHS": "3"}, cpu_milli=500
    )
    plain = alloc(api, gpus=1, models=["A100"])
    got: dict[str, Any] = {}

    def poll() -> None:
        t0 = time.monotonic()
        got["answer"] = assignments(api, "n1", n1, wait=20, since=empty["version"])
        got["took"] = time.monotonic() - t0

    t = threading.Thread(target=poll)
    t.start()
    time.sleep(0.3)
    assert "answer" not in got  # waiting: nothing changed yet
    rep = cycle(api)
    t.join(10)
    assert got["took"] < 10, got
    answer = got["answer"]
    assert answer["term"] == rep.term and answer["version"] != empty["version"]
    [asg] = answer["assignments"]  # the plain allocation is not run by agents
    assert asg["allocation_id"] == job["id"] and asg["attempt"] == 1 and asg["term"] == rep.term
    assert asg["command"] == ["python", "train.py"] and asg["env"] == {"EPOCHS": "3"}
    assert asg["isolation"] == "exclusive" and asg["cpu_milli"] == 500 and asg["tenant"] == "default"
    assert asg["slices"][0]["node"] == "n1"
    assert get(api, plain["id"])["state"] == "bound"
    # unchanged: a poll without wait answers at once with the same version
    assert assignments(api, "n1", n1, since=answer["version"])["version"] == answer["version"]
    # node scope: n2's credential may not read n1's work, users may not at all
    assert api.get("/api/v1/nodes/n1/assignments", headers=n2).status_code == 403
    assert api.get("/api/v1/nodes/n1/assignments", headers=api.admin).status_code == 403
    assert api.get("/api/v1/nodes/n1/assignments", headers=n1, params={"wait": 31}).status_code == 422

    out = report(api, "n1", n1, {"allocation_id": job["id"], "attempt": 1, "state": "running"})
    assert out == {"accepted": [job["id"]], "stale": []}
    j = get(api, job["id"])
    assert j["state"] == "active" and j["started_at"]
    stale = report(api, "n1", n1, {"allocation_id": job["id"], "attempt": 2, "state": "running"})
    assert stale["accepted"] == [] and stale["stale"][0]["attempt"] == 2
    assert report(api, "n2", n2, {"allocation_id": job["id"], "attempt": 1, "state": "running"})["stale"]
    assert report(api, "n1", n1, {"allocation_id": plain["id"], "attempt": 1, "state": "running"})["stale"]
    out = report(api, "n1", n1, {"allocation_id": job["id"], "attempt": 1, "state": "exited", "exit_code": 0})
    j = get(api, job["id"])
    assert j["state"] == "released" and j["reason"] == "exited 0" and j["exit_code"] == 0
    assert [e["state"] for e in j["events"]] == ["pending", "bound", "active", "released"]
    assert assignments(api, "n1", n1)["assignments"] == []
    # a report for an attempt that ended is stale (the agent stops it if it still runs)
    late = report(api, "n1", n1, {"allocation_id": job["id"], "attempt": 1, "state": "running"})
    assert late["stale"] and "released" in late["stale"][0]["reason"]

    bad = alloc(api, gpus=1, models=["A100"], command=["false"])
    cycle(api)
    report(api, "n1", n1, {"allocation_id": bad["id"], "attempt": 1, "state": "exited", "exit_code": 3})
    b = get(api, bad["id"])
    assert b["state"] == "failed" and b["exit_code"] == 3 and "exited 3" in b["reason"]
    r = api.post(
        "/api/v1/nodes/n1/reports", headers=n1, json={"reports": [{"allocation_id": 1, "state": "x"}]}
    )
    assert r.status_code == 422


def test_logs_append_and_read(api: Api) -> None:
    manual(api)
    n1 = join(api, "n1")
    n2 = join(api, "n2")
    api.tenant("acme")
    alice = api.user("alice", "acme", "member")
    bob = api.user("bob", "default", "member")
    job = alloc(api, alice, gpus=1, command=["echo", "hi"])
    cycle(api)
    node = get(api, job["id"])["nodes"][0]
    mine, other = (n1, n2) if node == "n1" else (n2, n1)
    url = f"{A}/{job['id']}/logs"

    def put(offset: int, data: str, headers: dict[str, str] = mine, stream: str = "stdout") -> Any:
        return api.post(
            url, headers=headers, json={"attempt": 1, "stream": stream, "offset": offset, "data": data}
        )

    assert put(0, "héllo\n").json() == {"next_offset": 7}
    assert put(3, "llo\nwor").json() == {"next_offset": 10}  # resent overlap is not doubled
    assert put(20, "gap").status_code == 409
    assert put(0, "err\n", stream="stderr").json() == {"next_offset": 4}
    assert put(0, "x", headers=other).status_code == 403
    assert (
        api.post(
            url, headers=mine, json={"attempt": 2, "stream": "stdout", "offset": 0, "data": ""}
        ).status_code
        == 409
    )
    first = api.ok("GET", url, headers=alice)
    assert (first["stdout"], first["stderr"]) == (
        {"data": "héllo\nwor", "next": 10},
        {"data": "err\n", "next": 4},
    )  # the two streams apart, each in order
    assert (first["rank"], first["ranks"], first["state"], first["ended"]) == (0, 1, "bound", False)
    later = api.ok("GET", url, headers=alice, params={"stdout": 7, "stderr": 4})
    assert (later["stdout"], later["stderr"]) == ({"data": "wor", "next": 10}, {"data": "", "next": 4})
    assert api.get(url, headers=alice, params={"rank": 1}).json()["field"] == "rank"  # one member only
    assert api.get(url, headers=bob).status_code == 404
    got: dict[str, Any] = {}

    def follow() -> None:
        got["answer"] = api.ok("GET", url, headers=alice, params={"stdout": 10, "stderr": 4, "wait": 20})

    t = threading.Thread(target=follow)
    t.start()
    time.sleep(0.3)
    assert "answer" not in got
    put(10, "ld\n")
    t.join(10)
    assert got["answer"]["stdout"] == {"data": "ld\n", "next": 13} and not got["answer"]["ended"]
    report(api, node, mine, {"allocation_id": job["id"], "attempt": 1, "state": "exited", "exit_code": 0})
    end = api.ok("GET", url, headers=alice, params={"stdout": 13, "stderr": 4, "wait": 5})
    assert (end["stdout"]["data"], end["stderr"]["data"], end["ended"]) == ("", "", True)
    assert (end["state"], end["exit_code"]) == ("released", 0)


def test_node_lost_requeues_restartable_and_fails_the_rest(make_api: Any) -> None:
    """Restartable work and a job that never started are requeued; what ran and cannot restart
    fails, and so does an allocation without a command (its user may have used it)."""
    api: Api = make_api(heartbeat_interval_s=5, suspect_after_s=50, lost_after_s=100)
    manual(api)
    n1 = join(api, "n1", devices=4)
    again = alloc(api, gpus=1, command=["sleep", "1000"], restartable=True)
    once = alloc(api, gpus=1, command=["sleep", "1000"])
    ran = alloc(api, gpus=1, command=["sleep", "1000"])
    plain = alloc(api, gpus=1)
    api.ok("POST", "/api/v1/nodes/n1/heartbeat", headers=n1)
    cycle(api)
    assert {get(api, x["id"])["state"] for x in (again, once, ran, plain)} == {"bound"}
    report(api, "n1", n1, {"allocation_id": ran["id"], "attempt": 1, "state": "running"})
    heartbeat_ago(api, "n1", 120)
    cycle(api)
    for x in (again, once):
        a = get(api, x["id"])
        assert (a["state"], a["attempt"], a["slices"]) == ("pending", 2, []) and "n1 lost" in a["reason"]
    for x in (ran, plain):
        g = get(api, x["id"])
        assert g["state"] == "failed" and g["reason"] == "node n1 lost" and g["ended_at"]
    api.ok("POST", f"{A}/{once['id']}/cancel")  # out of the way: the rest counts assignments
    # the node comes back: the requeued attempt is bound again; attempt 1 is stale for the agent
    api.ok("POST", "/api/v1/nodes/n1/heartbeat", headers=n1)
    cycle(api)
    a = get(api, again["id"])
    assert a["state"] == "bound" and a["attempt"] == 2
    [asg] = assignments(api, "n1", n1)["assignments"]
    assert asg["attempt"] == 2
    assert report(api, "n1", n1, {"allocation_id": again["id"], "attempt": 1, "state": "running"})["stale"]
    # lost by the agent (e.g. it restarted and the process is gone): a restartable job is requeued
    report(
        api,
        "n1",
        n1,
        {"allocation_id": again["id"], "attempt": 2, "state": "lost", "reason": "agent restart"},
    )
    a = get(api, again["id"])
    assert a["state"] == "pending" and a["attempt"] == 3 and "process lost" in a["reason"]
