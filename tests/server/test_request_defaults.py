"""What a request gets when it names no CPU or memory: its tenant's defaults, else the pool's, stored
in the request at admission (so the scheduler books them), and the process limit the agent gets."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from harness import Api, H
from test_allocations import alloc, cycle, get, join, manual
from test_allocations_agent import assignments

D = "/api/v1/tenants/{}/defaults"


def _defaults(api: Api, tenant: str, headers: H | None = None) -> dict[str, Any]:
    return dict(api.ok("GET", D.format(tenant), headers=headers))


def _change(api: Api, tenant: str, body: dict[str, Any], headers: H | None = None, expect: int = 200) -> Any:
    r = api.patch(D.format(tenant), json=body, headers=headers or api.admin)
    assert r.status_code == expect, r.text
    return r.json()


def test_defaults_are_the_pools_until_an_admin_sets_the_tenants(make_api: Callable[..., Api]) -> None:
    api = make_api(default_cpu_milli=500, default_memory_mib=768, default_pids_max=300)
    api.tenant("t")
    assert _defaults(api, "t") == {
        "tenant": "t",
        "cpu_milli": 500,
        "memory_mib": 768,
        "pids_max": 300,
        "time_limit_s": None,
        "max_time_limit_s": None,
        "max_array": None,
        "from_pool": ["cpu_milli", "memory_mib", "pids_max"],
    }
    out = _change(api, "t", {"cpu_milli": 2000, "memory_mib": 4096})
    assert (out["cpu_milli"], out["memory_mib"], out["pids_max"], out["from_pool"]) == (
        2000,
        4096,
        300,
        ["pids_max"],
    )
    # fields left out stay; null puts one back to the pool's
    out = _change(api, "t", {"pids_max": 64, "cpu_milli": None})
    assert (out["cpu_milli"], out["memory_mib"], out["pids_max"], out["from_pool"]) == (
        500,
        4096,
        64,
        ["cpu_milli"],
    )
    assert _defaults(api, "t") == out
    audit = api.ok("GET", "/api/v1/audit")["items"]
    assert any(r["target"] == "defaults:t" for r in audit)


def test_only_an_admin_changes_them_and_members_see_only_their_own(api: Api) -> None:
    api.tenant("a")
    api.tenant("b")
    member, tadmin = api.user("ma", "a", "member"), api.user("ta", "a", "tenant-admin")
    api.user("mb", "b", "member")
    assert _defaults(api, "a", member)["tenant"] == "a"
    for who in (member, tadmin):
        r = api.patch(D.format("a"), json={"memory_mib": 1 << 20}, headers=who)
        assert r.status_code == 403, r.text
    hidden, missing = api.get(D.format("b"), headers=member), api.get(D.format("nosuch"), headers=member)
    assert hidden.status_code == missing.status_code == 404
    assert hidden.json() == {"error": "tenant 'b' not found"}
    assert api.patch(D.format("nosuch"), json={"cpu_milli": 1}, headers=api.admin).status_code == 404
    assert _defaults(api, "a")["from_pool"] == ["cpu_milli", "memory_mib", "pids_max"]  # nothing changed


def test_bad_defaults_are_refused_naming_the_field(api: Api) -> None:
    api.tenant("t")
    for body, field in (
        ({"cpu_milli": 0}, "cpu_milli"),
        ({"cpu_milli": "1"}, "cpu_milli"),
        ({"memory_mib": -5}, "memory_mib"),
        ({"memory_mib": 2**40}, "memory_mib"),
        ({"pids_max": 4}, "pids_max"),
        ({"pids_max": 1.5}, "pids_max"),
        ({"cpus": 1}, "cpus"),
    ):
        r = api.patch(D.format("t"), json=body, headers=api.admin)
        assert r.status_code == 422, (body, r.text)
        assert r.json().get("field") == field, (body, r.text)


def test_admission_stores_and_books_the_defaults(api: Api) -> None:
    manual(api)
    api.tenant("t")
    member = api.user("m", "t", "member")
    join(api, "n1", devices=0, cpu_milli=2500, host_mib=65536)
    # nothing named, or 0 (the same): the pool's defaults (1 CPU, 1 GiB); what is named is kept
    a = alloc(api, member, command=["true"])
    b = alloc(api, member, command=["true"], cpu_milli=0, memory_mib=0)
    c = alloc(api, member, command=["true"], cpu_milli=300, memory_mib=100)
    assert [(x["request"]["cpu_milli"], x["request"]["memory_mib"]) for x in (a, b, c)] == [
        (1000, 1024),
        (1000, 1024),
        (300, 100),
    ]
    assert get(api, a["id"], member)["request"]["cpu_milli"] == 1000  # as stored, not only as answered
    cycle(api)
    assert [get(api, x["id"])["state"] for x in (a, b, c)] == ["bound", "bound", "bound"]
    # 2.3 of the node's 2.5 CPUs are booked: another request that names nothing waits for CPU
    d = alloc(api, member, command=["true"])
    cycle(api)
    assert get(api, d["id"])["state"] == "pending"
    assert "CPU" in api.ok("GET", f"/api/v1/allocations/{d['id']}/explain")["summary"]
    # the tenant's own defaults apply to the requests that come after
    _change(api, "t", {"cpu_milli": 150, "memory_mib": 64})
    e = alloc(api, member, command=["true"], memory_mib=32)
    assert (e["request"]["cpu_milli"], e["request"]["memory_mib"]) == (150, 32)
    cycle(api)
    assert get(api, e["id"])["state"] == "bound"


def test_a_default_over_the_tenants_quota_is_refused_with_the_reason(api: Api) -> None:
    api.tenant("t")
    join(api, "n1", devices=0)
    api.ok("PUT", "/api/v1/tenants/t/quota", json={"cpu_milli": {"guaranteed": 0, "limit": 500}})
    r = api.post("/api/v1/allocations", json={"tenant": "t", "command": ["true"]}, headers=api.admin)
    assert r.status_code == 422, r.text
    assert "names no CPU" in r.json()["error"] and "cpool tenants defaults t" in r.json()["error"], r.text
    # a CPU-only request within the quota is admitted and counted as before
    ok = alloc(api, tenant="t", command=["true"], cpu_milli=400)
    assert ok["request"]["cpu_milli"] == 400


def test_ceilings_give_a_time_limit_and_refuse_what_is_over_them_naming_them(api: Api) -> None:
    api.tenant("t")
    member = api.user("m", "t", "member")
    join(api, "n1", devices=0)
    plain = alloc(api, member, command=["true"], cpu_milli=100)
    assert plain["request"]["time_limit"] is None  # no ceiling: none given
    _change(api, "t", {"max_time_limit_s": 7200, "max_array": 4})
    # a job naming none gets the ceiling (no default set), one naming less keeps its own
    assert alloc(api, member, command=["true"], cpu_milli=100)["request"]["time_limit"] == 7200
    assert (
        alloc(api, member, command=["true"], cpu_milli=100, time_limit="30m")["request"]["time_limit"] == 1800
    )
    _change(api, "t", {"time_limit_s": 600})
    assert alloc(api, member, command=["true"], cpu_milli=100)["request"]["time_limit"] == 600
    for body, field, words in (
        ({"time_limit": "3h"}, "time_limit", "3h is over tenant t's longest, 2h"),
        ({"array": "0-9"}, "array", "10 jobs is over tenant t's largest array, 4"),
    ):
        r = api.post(
            "/api/v1/allocations", json={"command": ["true"], "cpu_milli": 100, **body}, headers=member
        )
        assert r.status_code == 422 and r.json()["field"] == field, r.text
        assert words in r.json()["error"] and "cpool tenants defaults t" in r.json()["error"], r.text
    assert len(alloc(api, member, command=["true"], cpu_milli=100, array="0-3")["request"]["array"]) > 0
    # a default over the ceiling is refused, naming the field that was given
    bad = _change(api, "t", {"time_limit_s": 9000}, expect=422)
    assert bad["field"] == "time_limit_s" and "over the longest" in bad["error"], bad
    out = _change(api, "t", {"time_limit_s": None, "max_time_limit_s": None, "max_array": None})
    assert (out["time_limit_s"], out["max_time_limit_s"], out["max_array"]) == (None, None, None)


def test_assignments_carry_the_tenants_process_limit(api: Api) -> None:
    manual(api)
    api.tenant("t")
    api.tenant("u")
    n1 = join(api, "n1", devices=0)
    _change(api, "t", {"pids_max": 77})
    ids = {alloc(api, tenant=t, command=["true"])["id"]: t for t in ("t", "u")}
    cycle(api)
    got = {x["allocation_id"]: x for x in assignments(api, "n1", n1)["assignments"]}
    assert {i: got[i]["pids_max"] for i in ids} == {i: 77 if t == "t" else 1024 for i, t in ids.items()}
    assert all(got[i]["memory_mib"] == 1024 and got[i]["cpu_milli"] == 1000 for i in ids)


def test_service_replicas_get_the_tenants_defaults(api: Api) -> None:
    manual(api)
    api.tenant("t")
    ctrl = api.app.state.service_controller
    ctrl.auto = False
    token = api.ok("POST", "/api/v1/join-tokens", json={})["token"]
    body = {"join_token": token, "name": "n1", "cpu_milli": 4000, "memory_mib": 8192, "address": "127.0.0.1"}
    api.ok("POST", "/api/v1/nodes/join", json=body, headers={})
    _change(api, "t", {"cpu_milli": 250, "memory_mib": 300})
    spec = {"request": {"command": ["engine"]}, "min_replicas": 1}
    r = api.put("/api/v1/services/s", json={"tenant": "t", "spec": spec}, headers=api.admin)
    assert r.status_code == 201, r.text
    api.app.state.controller.acquire()  # the (stopped) scheduling loop would hold the lease
    started = asyncio.run(ctrl.run_once()).started
    assert len(started) == 1
    req = get(api, started[0])["request"]
    assert (req["cpu_milli"], req["memory_mib"]) == (250, 300)
