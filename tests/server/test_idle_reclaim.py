"""Idle reclaim: a per-tenant policy (off by default) warns, then releases, allocations whose
devices report no use in heartbeats; use lifts the warning (SQLite and PostgreSQL)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from harness import Api
from test_allocations import alloc, cycle, explain, get, join, manual

from computepool.server.reclaim import Reclaimer, ReclaimReport

H = dict[str, str]
RECLAIM = "/api/v1/tenants/{}/reclaim"


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


def beat(api: Api, node: H, usage: dict[int, tuple[int, float]]) -> None:
    body = {
        "devices_usage": [
            {"index": i, "used_memory_mib": m, "utilization_pct": u} for i, (m, u) in usage.items()
        ]
    }
    api.ok("POST", "/api/v1/nodes/n1/heartbeat", headers=node, json=body)


def device(a: dict[str, Any]) -> int:
    return int(a["slices"][0]["device_index"])


def metric(api: Api, name: str, tenant: str) -> float:
    text = api.get("/metrics", headers=api.admin).text
    for line in text.splitlines():
        if line.startswith(f'{name}{{tenant="{tenant}"') and "cause" not in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_idle_allocations_are_warned_then_released_and_use_lifts_the_warning(api: Api) -> None:
    manual(api)
    rec = reclaimer(api)
    # the passes' own clock (the heartbeats say only whether a device was used): a busy host's slow
    # steps would otherwise add to the idle time and release where a warning was due
    clock = [datetime.now(UTC)]

    def later(seconds: float) -> datetime:
        clock[0] += timedelta(seconds=seconds)
        return clock[0]

    api.tenant("other")
    node = join(api, "n1", devices=4)
    assert api.ok("GET", RECLAIM.format("default"))["enabled"] is False  # off by default
    out = api.ok("PUT", RECLAIM.format("default"), json={"idle": "3s", "warn": "2s"})
    assert out == {**out, "tenant": "default", "enabled": True, "idle_s": 3, "warn_s": 2}
    idle = alloc(api, gpus=1)
    computing = alloc(api, gpus=1)
    copying = alloc(api, gpus=1)  # no compute, but its device memory keeps changing
    unpoliced = alloc(api, gpus=1, tenant="other")  # its tenant has no policy
    cycle(api)
    allocs = [get(api, a["id"]) for a in (idle, computing, copying, unpoliced)]
    assert [a["state"] for a in allocs] == ["bound"] * 4
    d_idle, d_comp, d_copy, d_other = (device(a) for a in allocs)

    def beat_all(idle_use: tuple[int, float], step: int) -> None:
        beat(api, node, {d_idle: idle_use, d_comp: (900, 40.0), d_copy: (100 * step, 0.0), d_other: (0, 0.0)})

    beat_all((0, 0.0), 1)
    assert rec.run_once(clock[0]).warned == []  # idle from now on
    later(1.1)
    beat_all((0, 0.0), 2)
    report = rec.run_once(clock[0])
    assert report.warned == [idle["id"]] and report.ended == []
    warned = get(api, idle["id"])
    assert warned["state"] == "bound" and warned["reason"].startswith("idle: no device use for 1s")
    assert "released in 2s unless used" in warned["reason"]
    assert warned["events"][-1]["reason"] == warned["reason"]
    assert "idle: no device use" in explain(api, idle["id"])["summary"]
    assert metric(api, "cpool_idle_warned_allocations", "default") == 1
    assert metric(api, "cpool_idle_warnings_total", "default") == 1
    # used again before the release: the warning is lifted
    beat_all((2048, 35.0), 3)
    report = rec.run_once(clock[0])
    assert report.warned == [idle["id"]] and report.ended == []
    assert get(api, idle["id"])["reason"] == "in use again: idle reclaim called off"
    assert metric(api, "cpool_idle_warned_allocations", "default") == 0
    # idle again: warned afresh, then released once idle for the whole policy time
    beat_all((2048, 0.0), 4)
    rec.run_once(clock[0])
    later(1.1)
    beat_all((2048, 0.0), 5)
    assert rec.run_once(clock[0]).warned == [idle["id"]]
    later(1.0)
    beat_all((2048, 0.0), 6)
    assert rec.run_once(clock[0]).ended == []  # idle 2 s of 3
    later(1.1)
    beat_all((2048, 0.0), 7)
    report = rec.run_once(clock[0])
    assert report.ended == [idle["id"]]
    released = get(api, idle["id"])
    assert released["state"] == "released"
    assert released["reason"].startswith("reclaimed: devices idle for 3s")
    reasons = [e["reason"] for e in released["events"]]
    assert sum(r.startswith("idle:") for r in reasons) == 2 and reasons[-1] == released["reason"]
    for other in (computing, copying, unpoliced):
        got = get(api, other["id"])
        assert got["state"] == "bound" and not got["reason"].startswith("idle"), got
    records = api.ok("GET", "/api/v1/audit", params={"action": "allocation.reclaim"})["items"]
    assert [r["target"] for r in records] == [f"allocation:{idle['id']}"]
    assert records[0]["actor"] == "scheduler" and records[0]["tenant"] == "default"
    assert metric(api, "cpool_idle_warned_allocations", "default") == 0
    # the freed device is placed again at once
    again = alloc(api, gpus=1)
    cycle(api)
    assert get(api, again["id"])["state"] == "bound"


def test_silent_nodes_never_make_an_allocation_idle(make_api: Any) -> None:
    api = make_api(heartbeat_interval_s=0.2, suspect_after_s=1.0, lost_after_s=30.0)
    manual(api)
    rec = reclaimer(api)
    node = join(api, "n1", devices=1)
    api.ok("PUT", RECLAIM.format("default"), json={"idle": 2, "warn": 1})
    a = alloc(api, gpus=1)
    beat(api, node, {0: (0, 0.0)})  # alive when placed: a loaded machine may take a second to get here
    cycle(api)
    assert get(api, a["id"])["state"] == "bound"
    beat(api, node, {0: (0, 0.0)})
    rec.run_once()
    time.sleep(2.2)  # no heartbeat since: the node is suspect, its devices say nothing
    assert rec.run_once().warned == [] and get(api, a["id"])["state"] == "bound"
    beat(api, node, {0: (0, 0.0)})
    assert rec.run_once().warned == []  # idleness starts again from this report


def test_the_policy_api_checks_its_input_and_who_may_set_it(api: Api) -> None:
    api.tenant("team")
    member = api.user("mia", "team", "member")
    url = RECLAIM.format("team")
    r = api.put(url, json={"idle": "10m", "warn": "10m"}, headers=api.admin)
    assert r.status_code == 422 and "warn" in r.json()["error"], r.text
    r = api.put(url, json={"idle": "soon"}, headers=api.admin)
    assert r.status_code == 422 and "idle" in r.json()["error"], r.text
    r = api.put(url, json={"idle": "10m", "grace": 1}, headers=api.admin)
    assert r.status_code == 422 and "grace" in r.text
    assert api.put(url, json={"idle": "10m"}, headers=member).status_code == 403
    out = api.ok("PUT", url, json={"idle": "30m", "warn": "10m"})
    assert (out["idle_s"], out["warn_s"]) == (1800, 600)
    assert api.ok("GET", url, headers=member)["idle_s"] == 1800  # members see their tenant's policy
    assert api.get(RECLAIM.format("default"), headers=member).status_code == 404
    assert api.get(RECLAIM.format("nope"), headers=api.admin).status_code == 404
    assert api.delete(url, headers=member).status_code == 403
    assert api.ok("DELETE", url) == {**api.ok("GET", url), "enabled": False}
    assert api.ok("GET", url)["idle_s"] is None
    actions = [r["action"] for r in api.ok("GET", "/api/v1/audit", params={"tenant": "team"})["items"]]
    assert actions.count("quota.set") >= 2


@pytest.mark.parametrize("bad", [{}, {"idle": 0}, {"idle": True}, {"idle": "1h", "warn": "-1"}])
def test_bad_policies_are_422(api: Api, bad: dict[str, Any]) -> None:
    r = api.put(RECLAIM.format("default"), json=bad, headers=api.admin)
    assert r.status_code == 422, r.text
