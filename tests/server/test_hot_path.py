"""The API's fast paths: long-poll for a state change, caches that never refuse wrongly,
the controller's incremental snapshot (equal to a full one), and bulk binds keeping the audit chain."""

from __future__ import annotations

import threading
import time
from typing import Any

from harness import Api
from test_allocations import A, alloc, cycle, get, join, manual

from computepool.server import scheduling
from computepool.server.scheduling import SnapshotCache


def _shape(snap: scheduling.Snapshot) -> tuple[Any, ...]:
    live = [
        (a.id, a.tenant, a.state, a.attempt, a.reason, a.nodes, a.slices, a.request, a.priority, a.bound_at)
        for a in snap.live
    ]
    return (snap.nodes, snap.weights, snap.quotas, live)


def test_long_poll_answers_when_the_allocation_is_bound(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=1)
    a = alloc(api, gpus=1, gpu_milli=500)
    timer = threading.Timer(0.5, lambda: cycle(api))
    t0 = time.monotonic()
    timer.start()
    try:
        got = api.ok("GET", f"{A}/{a['id']}", params={"wait": 30, "state": "pending"})
    finally:
        timer.join()
    assert got["state"] == "bound"  # woken by the binding: the deadline was 30 s away
    assert time.monotonic() - t0 > 0.4  # and it did wait for it


def test_long_poll_times_out_with_the_unchanged_state(api: Api) -> None:
    manual(api)
    a = alloc(api, gpus=0, cpu_milli=100)
    t0 = time.monotonic()
    got = api.ok("GET", f"{A}/{a['id']}", params={"wait": 0.3})
    assert got["state"] == "pending" and time.monotonic() - t0 > 0.25


def test_long_poll_is_checked_like_a_read(api: Api) -> None:
    manual(api)
    a = alloc(api, gpus=0, cpu_milli=100)
    api.tenant("other")
    stranger = api.user("eve", "other", "member")
    r = api.get(f"{A}/{a['id']}", params={"wait": 0.2}, headers=stranger)
    assert r.status_code == 404
    r = api.get(f"{A}/{a['id']}", params={"wait": 99}, headers=api.admin)
    assert r.status_code == 422 and "wait" in r.text


def test_cached_shape_never_refuses_a_request_a_new_node_can_hold(api: Api) -> None:
    manual(api)
    join(api, "small", devices=1, memory_mib=16384)
    alloc(api, gpus=1, gpu_milli=500)  # warms the shape cache with a pool of one small GPU
    # a second node joins through another replica: this process's cache has not seen it
    api.app.state.caches.shape.ttl_s = 3600
    other = api.app.state.caches.shape._shape
    join(api, "big", devices=4)
    api.app.state.caches.shape._shape = other  # as if the join had happened elsewhere
    big = alloc(api, gpus=4)
    assert big["state"] == "pending"
    # and one that no node can hold is still refused, after a fresh look
    r = api.post(A, json={"gpus": 9}, headers=api.admin)
    assert r.status_code == 422 and "could ever hold" in r.json()["error"]


def test_revoked_token_is_refused_at_once_despite_the_cache(api: Api) -> None:
    api.tenant("acme")
    h = api.user("bob", "acme", "member")
    assert api.get("/api/v1/whoami", headers=h).status_code == 200  # now cached
    token_id = h["Authorization"].split()[1].split(".")[0]
    api.ok("DELETE", f"/api/v1/tokens/{token_id}")
    assert api.get("/api/v1/whoami", headers=h).status_code == 401


def test_incremental_snapshot_equals_a_full_one(api: Api) -> None:
    manual(api)
    for n in ("n1", "n2"):
        join(api, n, devices=2)
    cache = SnapshotCache()
    db, settings = api.app.state.db, api.settings

    def same() -> None:
        with db.read() as s:
            inc = cache.load(s, settings)
        with db.read() as s:
            full = scheduling.load_snapshot(s, settings)
        assert _shape(inc) == _shape(full)

    ids = [alloc(api, gpus=1, gpu_milli=500)["id"] for _ in range(5)]
    same()
    cycle(api)  # binds: state and slices change
    same()
    api.ok("POST", f"{A}/{ids[0]}/release")
    api.ok("POST", f"{A}/{ids[1]}/cancel")
    alloc(api, gpus=2, gpu_milli=1000)  # waits: a reason is written by the next cycle
    cycle(api)
    same()
    api.ok("DELETE", "/api/v1/nodes/n2")
    join(api, "n3", devices=1)  # may reuse n2's row id: its devices must not be n2's
    cycle(api)
    same()


def test_bulk_binds_keep_the_audit_chain(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=4)
    ids = [alloc(api, gpus=1, gpu_milli=250)["id"] for _ in range(12)]
    rep = cycle(api)
    assert sorted(rep.result.bound) == ids
    assert {get(api, i)["state"] for i in ids} == {"bound"}
    assert api.ok("GET", "/api/v1/audit/verify")["ok"] is True
    binds = api.ok("GET", "/api/v1/audit", params={"action": "allocation.bind"})["items"]
    assert sorted(int(b["target"].split(":")[1]) for b in binds) == ids
