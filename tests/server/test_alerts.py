"""Alerts: the rules fire and resolve on real heartbeats, reports and scheduling state; a member sees
its tenant's alerts only; rules are retuned through the API (SQLite and PostgreSQL)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from harness import Api, H
from test_allocations import alloc, cycle, get, join, manual

from computepool.server.alerts import AlertEngine, AlertReport
from computepool.store.db import db_now

ALERTS = "/api/v1/alerts"
RULES = "/api/v1/alert-rules"


class Passes:
    """The app's alert engine, run by hand; each pass renews this replica's scheduling lease first,
    as the (here stopped) scheduling loop would."""

    def __init__(self, api: Api) -> None:
        manual(api)
        self.api = api
        self.engine: AlertEngine = api.app.state.alert_engine
        self.engine.auto = False
        self.engine.notifier.auto = False

    def run(self, ahead_s: float = 0.0) -> AlertReport:
        self.api.app.state.controller.acquire()
        now = None
        if ahead_s:
            with self.api.app.state.db.read() as s:
                now = db_now(s) + timedelta(seconds=ahead_s)
        return self.engine.run_once(now)


def beat(api: Api, node: str, headers: H, devices: dict[int, dict[str, Any]] | None = None) -> None:
    body = {"devices_usage": [{"index": i, **d} for i, d in (devices or {}).items()]}
    api.ok("POST", f"/api/v1/nodes/{node}/heartbeat", headers=headers, json=body)


def alerts(api: Api, headers: H | None = None, **params: str) -> list[dict[str, Any]]:
    return list(api.ok("GET", ALERTS, headers=headers, params=params)["items"])


def firing(api: Api, rule: str) -> list[dict[str, Any]]:
    return [a for a in alerts(api, state="firing") if a["rule"] == rule]


def tune(api: Api, rule: str, **body: Any) -> dict[str, Any]:
    return dict(api.ok("PUT", f"{RULES}/{rule}", json=body))


def test_a_silent_node_is_suspect_then_lost_and_resolves_when_it_returns(make_api: Any) -> None:
    # thresholds far apart, so that the passes' clock decides, however slowly the machine runs
    api = make_api(heartbeat_interval_s=0.2, suspect_after_s=50.0, lost_after_s=100.0)
    p = Passes(api)
    node = join(api, "n1", devices=1)
    assert p.run().fired == []  # a fresh heartbeat: nothing
    assert p.run(ahead_s=60).fired == [("node-suspect", "node/n1")]
    assert p.run(ahead_s=61).fired == []  # never a second firing alert for one subject
    rep = p.run(ahead_s=120)
    assert rep.fired == [("node-lost", "node/n1")] and rep.resolved == [("node-suspect", "node/n1")]
    [lost] = firing(api, "node-lost")
    assert lost["severity"] == "critical" and lost["tenant"] is None and "n1" in lost["summary"]
    beat(api, "n1", node)
    assert p.run().resolved == [("node-lost", "node/n1")]
    states = {(a["rule"], a["state"]) for a in alerts(api)}
    assert states == {("node-suspect", "resolved"), ("node-lost", "resolved")}
    # (the lost alert fired on the passes' clock, ahead of the real one that resolved it)
    assert all(a["resolved_at"] >= a["since"] for a in alerts(api) if a["rule"] == "node-suspect")
    assert alerts(api, state="firing") == []


def test_device_unhealthy_from_a_heartbeat_and_member_sees_only_its_tenant(api: Api) -> None:
    p = Passes(api)
    api.tenant("a")
    api.tenant("b")
    alice = api.user("alice", "a", "member")
    bob = api.user("bob", "b", "member")
    node = join(api, "n1", devices=2)
    ja = alloc(api, alice, gpus=1, name="train")
    jb = alloc(api, bob, gpus=1)
    cycle(api)
    dev = {x["id"]: int(get(api, x["id"])["slices"][0]["device_index"]) for x in (ja, jb)}
    sick = {"health": "XID 79: GPU has fallen off the bus", "utilization_pct": 50.0}
    beat(api, "n1", node, {dev[ja["id"]]: sick, dev[jb["id"]]: sick})
    p.run()
    got = {a["subject"]: a for a in firing(api, "device-unhealthy")}
    assert set(got) == {f"device/n1/{dev[ja['id']]}", f"device/n1/{dev[jb['id']]}"}
    mine = got[f"device/n1/{dev[ja['id']]}"]
    assert (
        mine["tenant"] == "a" and "XID 79" in mine["summary"] and mine["detail"]["allocations"] == [ja["id"]]
    )
    # a member sees its own tenant's alert, never another's or the pool's
    assert [a["subject"] for a in alerts(api, alice)] == [mine["subject"]]
    assert [a["tenant"] for a in alerts(api, bob)] == ["b"]
    # healthy again: resolved
    fine = {"health": "", "utilization_pct": 50.0}
    beat(api, "n1", node, {dev[ja["id"]]: fine, dev[jb["id"]]: fine})
    assert len(p.run().resolved) == 2
    assert firing(api, "device-unhealthy") == []
    # members read rules but change nothing and see no webhooks
    assert len(api.ok("GET", RULES, headers=alice)["items"]) == 11
    assert api.put(f"{RULES}/node-lost", json={"enabled": False}, headers=alice).status_code == 403
    assert api.get("/api/v1/webhooks", headers=alice).status_code == 403
    assert api.post("/api/v1/webhooks", json={"url": "http://x/"}, headers=alice).status_code == 403


def test_rules_are_retuned_and_bad_settings_refused(api: Api) -> None:
    rules = {r["name"]: r for r in api.ok("GET", RULES)["items"]}
    assert list(rules) == [
        "node-suspect", "node-lost", "nodes-silent", "device-unhealthy", "slice-memory-killed",
        "idle-devices", "fragmentation", "tenant-at-limit", "job-failing", "leader-changed",
        "audit-chain-broken",
    ]  # fmt: skip
    assert rules["node-lost"]["threshold"] == api.settings.lost_after_s
    assert rules["idle-devices"] == {
        **rules["idle-devices"],
        "duration_s": 1800,
        "unit": "%",
        "enabled": True,
    }
    out = tune(api, "idle-devices", threshold=5, duration_s=60)
    assert out["threshold"] == 5 and out["duration_s"] == 60 and out["enabled"] is True
    assert tune(api, "idle-devices", enabled=False) == {**out, "enabled": False}  # the rest kept
    r = api.put(f"{RULES}/no-such-rule", json={"enabled": False}, headers=api.admin)
    assert r.status_code == 404 and "no-such-rule" in r.json()["error"]
    for body, field in (({"threshold": -1}, "threshold"), ({"duration_s": -5}, "duration_s"),
                        ({"colour": "red"}, "colour"), ({"threshold": "lots"}, "threshold")):  # fmt: skip
        r = api.put(f"{RULES}/node-lost", json=body, headers=api.admin)
        assert r.status_code == 422 and field in r.text, r.text
    for params in ({"state": "sideways"}, {"since": "yesterday-ish"},
                   {"since": "9999-12-31T23:59:59-23:00"}, {"since": "0001-01-01T00:00:00+14:00"},
                   {"since": "99999999999d"}):  # fmt: skip
        r = api.get(ALERTS, params=params, headers=api.admin)
        assert r.status_code == 422 and next(iter(params)) in r.text, r.text
    records = api.ok("GET", "/api/v1/audit", params={"action": "alert.rule.set"})["items"]
    assert [x["target"] for x in records if x["outcome"] == "ok"] == ["alert-rule:idle-devices"] * 2
    assert all(x["outcome"].startswith("refused") for x in records[2:])


def test_idle_devices_tenant_at_limit_and_fragmentation(api: Api) -> None:
    p = Passes(api)
    api.tenant("a")
    alice = api.user("alice", "a", "member")
    node = join(api, "n1", devices=2)
    for rule in ("idle-devices", "tenant-at-limit", "fragmentation"):
        tune(api, rule, duration_s=0)
    # 0.6 on each device, and tenant a's 0.1 (its limit) beside one: 0.7 of a GPU is free in all,
    # but no device has it
    first, second = alloc(api, gpus=1, gpu_milli=600), alloc(api, gpus=1, gpu_milli=600)
    cycle(api)
    api.ok("PUT", "/api/v1/tenants/a/quota", json={"gpu_milli": {"guaranteed": 0, "limit": 100}})
    alloc(api, alice, gpus=1, gpu_milli=100)
    over = alloc(api, alice, gpus=1, gpu_milli=100)
    waiting = alloc(api, gpus=1, gpu_milli=700)
    cycle(api)
    assert get(api, over["id"])["reason"].startswith("quota:")
    assert get(api, waiting["id"])["state"] == "pending"
    d = {x["id"]: int(get(api, x["id"])["slices"][0]["device_index"]) for x in (first, second)}
    assert d[first["id"]] != d[second["id"]]
    beat(
        api,
        "n1",
        node,
        {d[first["id"]]: {"utilization_pct": 80.0}, d[second["id"]]: {"utilization_pct": 0.0}},
    )
    fired = set(p.run().fired)
    assert ("tenant-at-limit", "tenant/a") in fired
    assert ("fragmentation", f"allocation/{waiting['id']}") in fired
    assert ("fragmentation", f"allocation/{over['id']}") not in fired  # waits for quota, not room
    assert {s for r, s in fired if r == "idle-devices"} == {
        f"allocation/{second['id']}"
    }  # the busy one is not
    [limit] = firing(api, "tenant-at-limit")
    assert limit["tenant"] == "a" and limit["detail"]["waiting"] == [over["id"]]
    # the waiting request's room comes back in one piece: fragmentation resolves
    api.ok("POST", f"/api/v1/allocations/{first['id']}/release")
    cycle(api)
    assert get(api, waiting["id"])["state"] == "bound"
    assert ("fragmentation", f"allocation/{waiting['id']}") in p.run().resolved


def test_memory_kills_and_failing_jobs(api: Api) -> None:
    p = Passes(api)
    node = join(api, "n1", devices=1)
    job = alloc(api, gpus=1, gpu_milli=500, command=["python", "big.py"], name="big")
    cycle(api)
    kill = "GPU memory 9000 MiB over slice limit 20480 MiB on GPU-n1-0"
    rep = {"allocation_id": job["id"], "attempt": 1, "state": "failed", "reason": kill}
    api.ok("POST", "/api/v1/nodes/n1/reports", headers=node, json={"reports": [rep]})
    assert p.run().fired == [("slice-memory-killed", f"allocation/{job['id']}")]
    [killed] = firing(api, "slice-memory-killed")
    assert killed["tenant"] == "default" and kill in killed["summary"]
    # the same job failing twice more: three failures in the hour
    for _ in range(2):
        again = alloc(api, gpus=1, gpu_milli=500, command=["python", "big.py"], name="big")
        cycle(api)
        rep = {"allocation_id": again["id"], "attempt": 1, "state": "exited", "exit_code": 1}
        api.ok("POST", "/api/v1/nodes/n1/reports", headers=node, json={"reports": [rep]})
    assert ("job-failing", "job/default/big") in p.run().fired
    [failing] = firing(api, "job-failing")
    assert "3 failures" in failing["summary"] and len(failing["detail"]["allocations"]) == 3
    assert p.run().fired == []
    # an hour on, past both windows: both resolve (the silent node is lost by then)
    later = p.run(ahead_s=3700)
    assert set(later.resolved) == {
        ("job-failing", "job/default/big"),
        ("slice-memory-killed", f"allocation/{job['id']}"),
    }


def test_a_disabled_rule_resolves_what_it_fired(make_api: Any) -> None:
    api = make_api(heartbeat_interval_s=0.2, suspect_after_s=1.0, lost_after_s=60.0)
    p = Passes(api)
    join(api, "n1", devices=1)
    assert p.run(ahead_s=2).fired == [("node-suspect", "node/n1")]
    tune(api, "node-suspect", enabled=False)
    assert p.run(ahead_s=2).resolved == [("node-suspect", "node/n1")]
    assert p.run(ahead_s=3).fired == []
