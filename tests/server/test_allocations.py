"""Allocations end to end: nodes join, requests are bound with slices, explained, released, cancelled."""

from __future__ import annotations

import time
from typing import Any

import pytest
from harness import Api, H

A = "/api/v1/allocations"


# --- helpers (shared with the other allocation and scheduling tests) ----------------------------
def join(
    api: Api,
    name: str,
    devices: int = 1,
    *,
    model: str = "A100",
    memory_mib: int = 40960,
    compute_milli: int = 1000,
    cpu_milli: int = 16000,
    host_mib: int = 65536,
) -> H:
    """Join a simulated node through the join protocol; its credential's headers."""
    token = api.ok("POST", "/api/v1/join-tokens", json={})["token"]
    body = {
        "join_token": token,
        "name": name,
        "cpu_milli": cpu_milli,
        "memory_mib": host_mib,
        "labels": {},
        "devices": [
            {
                "index": i,
                "vendor": "simulated",
                "model": model,
                "memory_mib": memory_mib,
                "uuid": f"GPU-{name}-{i}",
                "compute_milli": compute_milli,
            }
            for i in range(devices)
        ],
    }
    cred = api.ok("POST", "/api/v1/nodes/join", json=body, headers={})["credential"]
    return {"Authorization": f"Bearer {cred}"}


def manual(api: Api) -> None:
    """Stop the background loop: the test runs cycles itself, so their order is deterministic."""
    api.app.state.controller.auto = False


def cycle(api: Api) -> Any:
    return api.app.state.controller.run_once()


def alloc(api: Api, headers: H | None = None, expect: int = 201, **body: Any) -> dict[str, Any]:
    r = api.post(A, json=body, headers=headers or api.admin)
    assert r.status_code == expect, r.text
    return dict(r.json())


def get(api: Api, alloc_id: int, headers: H | None = None) -> dict[str, Any]:
    return dict(api.ok("GET", f"{A}/{alloc_id}", headers=headers))


def explain(api: Api, alloc_id: int, headers: H | None = None) -> dict[str, Any]:
    return dict(api.ok("GET", f"{A}/{alloc_id}/explain", headers=headers))


# --- tests ----------------------------------------------------------------------------------------
def test_create_bind_explain_release(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=2)
    a = alloc(api, name="train", gpus=1, cpu_milli=2000, memory_mib=1024)
    assert a["state"] == "pending" and a["tenant"] == "default" and a["owner"] == "admin"
    assert a["request"]["isolation"] == "exclusive" and a["attempt"] == 1
    assert explain(api, a["id"])["queue_position"] == 1
    rep = cycle(api)
    assert rep.leader and rep.result.bound == [a["id"]]
    b = get(api, a["id"])
    assert b["state"] == "bound" and b["nodes"] == ["n1"] and b["term"] == rep.term >= 1
    assert len(b["slices"]) == 1
    sl = b["slices"][0]
    assert sl["node"] == "n1" and sl["compute_milli"] == 1000 and sl["memory_mib"] == 40960
    assert sl["device_uuid"] == f"GPU-n1-{sl['device_index']}" and sl["isolation"] == "exclusive"
    assert [e["state"] for e in b["events"]] == ["pending", "bound"] and b["bound_at"]
    ex = explain(api, a["id"])
    assert ex["state"] == "bound" and "n1" in ex["summary"] and ex["queue_position"] is None
    assert ex["quota"]["gpu_milli"]["used"] == 1000
    listed = api.ok("GET", A, params={"state": "bound"})["items"]
    assert [x["id"] for x in listed] == [a["id"]]
    r = api.ok("POST", f"{A}/{a['id']}/release")
    assert r["state"] == "released" and r["ended_at"] and "released by user:admin" in r["reason"]
    assert api.post(f"{A}/{a['id']}/release", headers=api.admin).status_code == 409
    audit = api.ok("GET", "/api/v1/audit", params={"actor": "scheduler"})["items"]
    assert [x["action"] for x in audit] == ["allocation.bind"]
    assert audit[0]["detail"]["term"] == rep.term
    assert api.ok("GET", "/api/v1/audit/verify")["ok"]


def test_list_leaves_history_out_unless_asked(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=2)
    api.tenant("acme")
    alice = api.user("alice", "acme", "member")
    mine = alloc(api, alice, gpus=1)
    other = alloc(api, gpus=1)
    cycle(api)
    plain = api.ok("GET", A)["items"]
    assert [x["id"] for x in plain] == [other["id"], mine["id"]]
    assert all(x["events"] is None and x["state"] == "bound" and x["slices"] for x in plain)
    assert [x["tenant"] for x in plain] == ["default", "acme"]
    full = api.ok("GET", A, params={"events": "true", "state": "bound"})["items"]
    assert [[e["state"] for e in x["events"]] for x in full] == [["pending", "bound"]] * 2
    assert dict(full[1], events=None) == plain[1]  # the rest is the same
    seen = api.ok("GET", A, headers=alice, params={"events": "true"})["items"]  # still one tenant's
    assert [x["id"] for x in seen] == [mine["id"]] and len(seen[0]["events"]) == 2
    assert get(api, mine["id"])["events"] == seen[0]["events"]  # one allocation: always its history
    r = api.get(A, headers=api.admin, params={"events": "maybe"})
    assert r.status_code == 422 and "events" in r.text


def test_background_loop_binds_by_itself(api: Api) -> None:
    join(api, "n1")
    a = alloc(api, gpus=1)
    deadline = time.monotonic() + 10
    while get(api, a["id"])["state"] != "bound":
        assert time.monotonic() < deadline, "the scheduling loop did not bind the allocation"
        time.sleep(0.05)


def test_fractional_sharing_and_why_pending(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=1)
    ids = [alloc(api, gpus=1, gpu_milli=500)["id"] for _ in range(3)]
    cycle(api)
    got = [get(api, i) for i in ids]
    assert [g["state"] for g in got] == ["bound", "bound", "pending"]
    for g in got[:2]:
        assert g["slices"][0]["compute_milli"] == 500 and g["slices"][0]["memory_mib"] == 20480
        assert g["slices"][0]["isolation"] == "timeslice" and g["slices"][0]["device_index"] == 0
    ex = explain(api, ids[2])
    assert ex["state"] == "pending" and "500m" in ex["summary"], ex
    assert ex["reasons"]["counts"] == {"no GPU with 500m free": 1}
    assert ex["queue_position"] == 1
    assert "500m" in get(api, ids[2])["reason"]
    api.ok("POST", f"{A}/{ids[0]}/release")
    cycle(api)
    assert get(api, ids[2])["state"] == "bound"


def test_exclusive_is_alone(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=1)
    small = alloc(api, gpus=1, gpu_milli=300, isolation="mps")
    excl = alloc(api, gpus=1, exclusive=True)
    cycle(api)
    assert get(api, small["id"])["state"] == "bound"
    assert get(api, excl["id"])["state"] == "pending"
    assert "idle GPU" in explain(api, excl["id"])["summary"]
    api.ok("POST", f"{A}/{small['id']}/release")
    cycle(api)
    assert get(api, excl["id"])["slices"][0]["isolation"] == "exclusive"
    late = alloc(api, gpus=1, gpu_milli=100)
    cycle(api)
    assert get(api, late["id"])["state"] == "pending"


def test_gang_is_all_or_nothing(api: Api) -> None:
    manual(api)
    for n in ("n1", "n2", "n3"):
        join(api, n, devices=1)
    first = alloc(api, gpus=1)
    cycle(api)
    gang = alloc(api, gpus=1, gang_nodes=3)
    cycle(api)
    g = get(api, gang["id"])
    assert g["state"] == "pending" and g["slices"] == [] and g["nodes"] == []
    assert any("gang" in n for n in explain(api, gang["id"])["reasons"]["notes"])
    api.ok("POST", f"{A}/{first['id']}/release")
    cycle(api)
    g = get(api, gang["id"])
    assert g["state"] == "bound" and sorted(g["nodes"]) == ["n1", "n2", "n3"]
    assert sorted(s["node"] for s in g["slices"]) == ["n1", "n2", "n3"]
    # more nodes than the pool has: refused up front
    r = api.post(A, json={"gpus": 1, "gang_nodes": 4}, headers=api.admin)
    assert r.status_code == 422 and "ever" in r.json()["error"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"gpus": 2, "gpu_milli": 500}, "gpu_milli"),
        ({"gpu_milli": 500}, "gpu_milli"),
        ({"gpus": -1}, "gpus"),
        ({"gpus": "2"}, "gpus"),
        ({"gpus": 1, "isolation": "bogus"}, "isolation"),
        ({"gpus": 1, "gpu_milli": 500, "exclusive": True}, "isolation"),
        ({"gpus": 1, "exclusive": True, "isolation": "mps"}, "isolation"),
        ({"gpus": 1, "colour": "red"}, "colour"),
        ({"gpus": 1, "command": []}, "command"),
        ({"gpus": 1, "env": {"1BAD": "x"}}, "env.1BAD.[key]"),
        ({"gpus": 1, "command": ["echo", "a\x00b"]}, "command[1]"),
        ({"gpus": 1, "env": {"OK": "a\x00b"}}, "env.OK"),
        ({"gpus": 1, "gang_nodes": 0}, "gang_nodes"),
        ({"gpus": 9}, "gpus"),
        ({"gpus": 1, "models": ["H100"]}, "models"),
        ({"gpus": 1, "gpu_memory_mib": 100000}, "gpu_memory_mib"),
        ({"gpus": 2, "isolation": "mps"}, "isolation"),
        ({"gpus": 1, "mig": "1g.10gb"}, "mig"),
        ({"cpu_milli": 10**8}, "cpu_milli"),
        ({"tenant": "nosuch", "gpus": 1}, "tenant"),
        ({"gpus": 1, "vendors": ["nvdia"]}, "vendors"),
        ({"gpus": 1, "vendors": []}, "vendors"),
        ({"vendors": ["amd"]}, "vendors"),  # no device to be of that vendor
        ({"gpus": 1, "vendors": ["amd"]}, "vendors"),  # no AMD device in this pool
        ({"gpus": 1, "min_gpu_memory_mib": 0}, "min_gpu_memory_mib"),
        ({"gpus": 1, "min_gpu_memory_mib": 10**6}, "min_gpu_memory_mib"),
        ({"gpus": 1, "stacks": {"cuda": "twelve"}}, "stacks.cuda"),
        ({"gpus": 1, "stacks": {"CUDA!": "12.4"}}, "stacks"),
    ],
)
def test_bad_requests_are_422_naming_the_field(api: Api, body: dict[str, Any], field: str) -> None:
    join(api, "n1", devices=2)
    r = api.post(A, json=body, headers=api.admin)
    assert r.status_code in (404, 422), r.text
    assert r.json().get("field", "body") == field or r.json()["field"].startswith(field), r.json()
    assert api.ok("GET", A)["items"] == []


def test_tenants_and_roles(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=2)
    api.tenant("acme")
    api.tenant("other")
    alice = api.user("alice", "acme", "member")
    bob = api.user("bob", "other", "member")
    viewer = api.user("vic", "acme", "viewer")
    a = alloc(api, alice, gpus=1)
    assert a["tenant"] == "acme" and a["owner"] == "alice"
    assert api.get(f"{A}/{a['id']}", headers=bob).status_code == 404
    assert api.get(f"{A}/{a['id']}/explain", headers=bob).status_code == 404
    assert api.post(f"{A}/{a['id']}/cancel", headers=bob).status_code == 404
    assert get(api, a["id"], viewer)["id"] == a["id"]
    assert api.post(A, json={"gpus": 1}, headers=viewer).status_code == 403
    assert api.post(A, json={"gpus": 1, "tenant": "other"}, headers=alice).status_code == 404
    assert alloc(api, api.admin, gpus=1, tenant="other")["tenant"] == "other"
    assert [x["tenant"] for x in api.ok("GET", A, headers=bob)["items"]] == ["other"]
    assert api.ok("GET", A, headers=bob, params={"tenant": "acme"})["items"] == []
    assert len(api.ok("GET", A)["items"]) == 2
    # a quota limit the request alone exceeds: refused up front, naming the limit
    api.ok("PUT", "/api/v1/tenants/acme/quota", json={"gpu_milli": {"guaranteed": 0, "limit": 1000}})
    r = api.post(A, json={"gpus": 2}, headers=alice)
    assert r.status_code == 422 and "limit" in r.json()["error"]


def test_idempotency_key(api: Api) -> None:
    manual(api)
    join(api, "n1")
    key = {**api.admin, "Idempotency-Key": "job-42"}
    r1 = api.post(A, json={"gpus": 1}, headers=key)
    r2 = api.post(A, json={"gpus": 1}, headers=key)
    assert (r1.status_code, r2.status_code) == (201, 200)
    assert r1.json()["id"] == r2.json()["id"]
    api.tenant("acme")
    alice = api.user("alice", "acme", "member")
    r3 = api.post(A, json={"gpus": 1}, headers={**alice, "Idempotency-Key": "job-42"})
    assert r3.status_code == 201 and r3.json()["id"] != r1.json()["id"]
    bad = api.post(A, json={"gpus": 1}, headers={**api.admin, "Idempotency-Key": "no spaces"})
    assert bad.status_code == 422
    assert len(api.ok("GET", A)["items"]) == 2


def test_cancel(api: Api) -> None:
    manual(api)
    join(api, "n1")
    bound = alloc(api, gpus=1)
    cycle(api)
    waiting = alloc(api, gpus=1)
    cycle(api)
    assert api.ok("POST", f"{A}/{waiting['id']}/cancel")["state"] == "cancelled"
    assert api.post(f"{A}/{waiting['id']}/cancel", headers=api.admin).status_code == 409
    assert api.post(f"{A}/{waiting['id']}/release", headers=api.admin).status_code == 409
    c = api.ok("POST", f"{A}/{bound['id']}/cancel")
    assert c["state"] == "cancelled" and [e["state"] for e in c["events"]] == [
        "pending",
        "bound",
        "cancelled",
    ]
    assert explain(api, bound["id"])["summary"].startswith("cancelled")
    assert api.get(f"{A}/999999", headers=api.admin).status_code == 404


def test_metrics_for_admins_only(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=2)
    alloc(api, gpus=1, gpu_milli=250)
    cycle(api)
    api.tenant("acme")
    member = api.user("alice", "acme", "member")
    r = api.get("/metrics", headers=api.admin)
    assert r.status_code == 200, r.text
    text = r.text
    assert 'cpool_device_capacity_milli{device="0",model="A100",node="n1"} 1000.0' in text
    assert 'cpool_device_allocated_milli{device="0",model="A100",node="n1"} 250.0' in text
    assert 'cpool_tenant_usage{model="",resource="gpu_milli",tenant="default"} 250.0' in text
    assert 'cpool_pending_allocations{tenant="acme"} 0.0' in text
    assert "cpool_scheduling_cycle_seconds_count" in text and "cpool_api_request_seconds_bucket" in text
    assert api.get("/metrics", headers=member).status_code == 403
    assert api.get("/metrics").status_code == 401


def test_requests_wait_for_the_first_node(api: Api) -> None:
    manual(api)
    a = alloc(api, gpus=1)
    assert cycle(api).leader
    ex = explain(api, a["id"])
    assert ex["state"] == "pending" and "no nodes" in " ".join(ex["reasons"]["notes"])
    join(api, "n1")
    cycle(api)
    assert get(api, a["id"])["state"] == "bound"
