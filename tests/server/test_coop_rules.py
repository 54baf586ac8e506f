"""The coop controller's safety rules on the real app (SQLite and PostgreSQL): RPC shards only at
the address the control plane knows the peer by (loopback only for a head on loopback) and only
from fresh peer reports; a secret per plan, in the env of its RPC servers and head, never in argv
nor shown; failed plans retried with a back-off; probes sized from the model, pinned by the
service's own selector and tolerations, and given up when never started; measurements kept per
tenant and per model file."""

from __future__ import annotations

import os
import subprocess
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import select, update
from test_allocations import get
from test_coop_controller import PY, Coop, measure, probe_line

from computepool.server.coop.state import State, expire_exclusions
from computepool.store.models import Allocation, CoopMeasurement, Service

S = "/api/v1/services"


@pytest.fixture
def coop(make_api: Any) -> Coop:
    return Coop(make_api(rpc_port_min=32100, rpc_port_max=32110))


def pass_(c: Coop, name: str = "one") -> dict[str, Any]:
    c.step_only()
    return c.plan(name)


def db_alloc(c: Coop, alloc_id: int) -> Allocation:
    with c.ctrl.db.read() as s:
        a = s.get(Allocation, alloc_id)
        assert a is not None
        s.expunge(a)
        return a


def db_spec(c: Coop, name: str = "big") -> dict[str, Any]:
    with c.ctrl.db.read() as s:
        return dict(s.scalars(select(Service.spec).where(Service.name == name)).one())


def test_rpc_shards_only_at_the_address_the_pool_knows(coop: Coop) -> None:
    for i in (1, 2, 3):
        coop.join(f"n{i}", f"10.1.0.{i}")
    # n1 saw n2 at an address the pool does not know n2 by (a key holder posing as n2), n3 where it is
    coop.peers("n1", "n2", "n3", at={"n2": "10.1.0.9", "n3": "10.1.0.3"})
    coop.put(force_split=2)
    coop.step()
    measure(coop, {"n1": 60.0, "n2": 50.0, "n3": 40.0})
    out = coop.step()
    assert out["status"] == "starting", out
    rpc = [s for s in out["shards"] if s["role"] == "rpc"]
    assert [(s["node"], s["endpoint"].split(":")[0]) for s in rpc] == [("n3", "10.1.0.3")], out
    assert "announced at 10.1.0.9, but the pool knows the node at 10.1.0.2" in out["reason"], out["reason"]
    [server] = coop.coop_allocs("rpc")
    assert server["request"]["node_selector"] == {"cpool.io/node": "n3"}
    assert server["command"][-6:-4] == ["--host", "10.1.0.3"]


def test_a_loopback_peer_only_for_a_head_on_loopback(coop: Coop) -> None:
    coop.join("n1", "10.1.0.1")
    coop.join("n2", "127.0.0.1")  # its record and its announcement agree, but loopback is n1's own
    coop.peers("n1", "n2", at={"n2": "127.0.0.1"})
    coop.put()
    coop.step()
    measure(coop, {"n1": 60.0, "n2": 50.0})
    out = coop.step()
    assert [(s["node"], s["role"]) for s in out["shards"]] == [("n1", "head")], out
    assert "127.0.0.1 is loopback or link-local, and the head n1 is not" in out["reason"], out["reason"]
    assert coop.coop_allocs("rpc") == []


def test_stale_peer_reports_are_not_used(coop: Coop) -> None:
    coop.join("n1")
    coop.join("n2")
    coop.peers("n1", "n2", last_seen=datetime.now(UTC) - timedelta(minutes=5))
    coop.put(force_split=2)
    coop.step()
    measure(coop, {"n1": 60.0, "n2": 40.0})
    out = coop.step()
    assert coop.coop_allocs("rpc") == [], out
    assert out["status"] == "failed" or [s["role"] for s in out["shards"]] == ["head"], out
    coop.peers("n1", "n2")  # seen again now: the next plan may split
    coop.advance(2.1)  # past the failed plan's first back-off
    again = coop.step()
    assert [s["role"] for s in again["shards"]] == ["head", "rpc"], again


def test_each_plan_has_its_own_secret_never_in_argv_nor_shown(coop: Coop) -> None:
    coop.join("n1")
    coop.join("n2")
    coop.peers("n1", "n2")
    coop.put(force_split=2)
    coop.step()
    measure(coop, {"n1": 60.0, "n2": 40.0})
    placed = coop.step()
    rpc = next(s for s in placed["shards"] if s["role"] == "rpc")
    [server] = coop.coop_allocs("rpc")
    secret = db_alloc(coop, server["id"]).env["CPOOL_COOP_SECRET"]
    assert len(secret) == 64 and int(secret, 16) >= 0
    shown = get(coop.api, server["id"])
    assert secret not in str(shown) and shown["env"]["CPOOL_COOP_SECRET"] == "(hidden)", shown
    coop.run(server["id"], f"CPOOL-RPC ready {rpc['endpoint']}\n")
    assert coop.step()["reason"].startswith("head replica starting on n1")
    spec = db_spec(coop)
    assert spec["request"]["env"]["COOP_PLAN_SECRET"] == secret
    cmd = spec["request"]["command"]
    assert all(secret not in arg for arg in cmd)
    # the head's shell hands it to the engine as CPOOL_COOP_SECRET, and the spec's name goes
    probe = ["/bin/sh", "-c", 'printf "%s|%s|%s" "$CPOOL_COOP_SECRET" "${COOP_PLAN_SECRET-gone}" "$1"']
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "COOP_PLAN_SECRET": secret, "PORT": "4242"}
    ran = subprocess.run([*cmd[:3], *probe], env=env, capture_output=True, text=True, timeout=30, check=True)
    assert ran.stdout == f"{secret}|gone|4242", ran
    # readers of the service (API, `cpool services`) never see it
    for path in (f"{S}/big", S):
        r = coop.api.get(path, headers=coop.api.admin)
        assert r.status_code == 200 and secret not in r.text, r.text
    # the head replica, as the service controller starts it, hides it too
    coop.api.app.state.service_controller.auto = False
    import asyncio

    asyncio.run(coop.api.app.state.service_controller.run_once())
    replicas = [a for a in coop.api.ok("GET", "/api/v1/allocations")["items"] if a["name"] == "svc-big"]
    assert replicas and all(secret not in str(a) for a in replicas), replicas
    # a new plan, a new secret
    coop.exit(server["id"], code=137)
    assert coop.step()["status"] == "replanning"
    coop.step()
    fresh = db_spec(coop)["request"]["env"]["COOP_PLAN_SECRET"]
    assert len(fresh) == 64 and fresh != secret


def test_a_failed_plan_is_retried_with_a_back_off_and_leaves_nothing_behind(make_api: Any) -> None:
    c = Coop(make_api(rpc_port_min=32100, rpc_port_max=32100))  # one RPC port in all
    c.put()
    first = c.step()  # no node at all
    assert first["status"] == "failed" and first["attempt"] == 1 and "no ready node" in first["reason"], first
    assert c.step()["updated_at"] == first["updated_at"]  # no re-plan on every pass
    c.advance(2.1)
    assert c.step()["attempt"] == 2
    c.api.ok("DELETE", f"{S}/big")
    # a split over three nodes, one RPC port: the plan fails and ends the RPC server it asked for
    for n in ("n1", "n2", "n3"):
        c.join(n)
    c.peers("n1", "n2", "n3")
    c.put("one", force_split=3)
    pass_(c)
    for a in c.coop_allocs("probe"):  # a model of four layers: three nodes can share it
        node = a["request"]["node_selector"]["cpool.io/node"]
        c.run(
            a["id"],
            probe_line({"n1": 60.0, "n2": 40.0, "n3": 30.0}[node]).replace('"n_layer": 2', '"n_layer": 4'),
        )
        c.exit(a["id"])
    one = pass_(c)
    assert one["status"] == "failed" and "every RPC port 32100-32100 is taken" in one["reason"], one
    [server] = c.coop_allocs("rpc")
    assert server["state"] == "cancelled", server
    pass_(c)
    assert c.plan("one")["updated_at"] == one["updated_at"]  # backing off: nothing made and ended
    assert len(c.coop_allocs("rpc")) == 1


def test_probes_are_sized_placed_like_the_service_and_given_up_when_never_started(coop: Coop) -> None:
    for n in ("n1", "n2", "n3"):
        coop.join(n)
    labels = {
        "n1": ({"zone": "a"}, {"dedicated": "ml"}),
        "n2": ({"zone": "a"}, {}),
        "n3": ({"zone": "b"}, {}),
    }
    for n, (lab, taints) in labels.items():
        body = {"labels": lab, "taints": taints}
        r = coop.api.put(f"/api/v1/nodes/{n}", json=body, headers=coop.api.admin)
        assert r.status_code == 200, r.text
    spec = {
        "request": {"cpu_milli": 1000, "node_selector": {"zone": "a"}, "tolerations": ["dedicated"]},
        "cooperative": {"model": "/m/tiny.gguf", "engine_python": PY},
    }
    assert coop.api.put(f"{S}/big", json={"spec": spec}, headers=coop.api.admin).status_code == 201
    coop.step()
    probes = {a["request"]["node_selector"]["cpool.io/node"]: a for a in coop.coop_allocs("probe")}
    assert set(probes) == {"n1", "n2"}  # n3 is not in the service's zone
    for n, a in probes.items():
        assert a["request"]["node_selector"] == {"zone": "a", "cpool.io/node": n}
        assert a["request"]["tolerations"] == ["dedicated"]
        assert a["request"]["memory_mib"] == 8192  # the file's size is not known yet: the node's memory
    coop.run(probes["n1"]["id"], probe_line(30.0))
    coop.exit(probes["n1"]["id"])
    # n2's probe never starts: after the deadline its node is given up for this plan
    with coop.ctrl.db.write() as s:
        old = datetime.now(UTC) - timedelta(seconds=200)
        s.execute(update(Allocation).where(Allocation.id == probes["n2"]["id"]).values(created_at=old))
    out = coop.step()
    assert out["status"] == "starting" and [s["node"] for s in out["shards"]] == ["n1"], out
    n2 = next(c for c in out["candidates"] if c["node"] == "n2")
    assert "not started within 120 s" in n2["note"], n2
    assert get(coop.api, probes["n2"]["id"])["state"] == "cancelled"
    assert next(c for c in out["candidates"] if c["node"] == "n1")["holds_model"] is True
    n3 = next(c for c in out["candidates"] if c["node"] == "n3")
    assert n3["note"] == "not admitted by the service's node selector or tolerations", n3
    # once a probe read the file's size, the next ones ask for the model and the engine's own
    spec["cooperative"]["ctx"] = 256
    coop.api.put(f"{S}/other", json={"spec": spec}, headers=coop.api.admin)
    coop.step()
    [again] = [a for a in coop.coop_allocs("probe") if a["state"] == "pending"]
    assert again["request"]["node_selector"]["cpool.io/node"] == "n2"
    assert again["request"]["memory_mib"] == 1 + 256  # 400 kB x 1.15, in MiB, rounded up


def test_an_rpc_server_never_started_is_given_up(coop: Coop) -> None:
    coop.join("n1")
    coop.join("n2")
    coop.peers("n1", "n2")
    coop.put(force_split=2)
    coop.step()
    measure(coop, {"n1": 60.0, "n2": 40.0})
    assert coop.step()["status"] == "starting"
    [server] = coop.coop_allocs("rpc")
    assert coop.step()["reason"].startswith("waiting for RPC servers on n2")
    with coop.ctrl.db.write() as s:
        old = datetime.now(UTC) - timedelta(seconds=200)
        s.execute(update(Allocation).where(Allocation.id == server["id"]).values(created_at=old))
    out = coop.step()
    assert out["status"] == "replanning" and "RPC server on n2 not started within 120 s" in out["reason"], out
    assert get(coop.api, server["id"])["state"] == "cancelled"
    single = coop.step()
    assert [(s["node"], s["role"]) for s in single["shards"]] == [("n1", "head")], single


def test_a_head_failing_before_its_rpc_server_still_leaves_the_lost_node_out(coop: Coop) -> None:
    import asyncio

    coop.join("n1")
    coop.join("n2")
    coop.peers("n1", "n2")
    coop.put(force_split=2)
    coop.step()
    measure(coop, {"n1": 60.0, "n2": 40.0})
    rpc = next(s for s in coop.step()["shards"] if s["role"] == "rpc")
    [server] = coop.coop_allocs("rpc")
    coop.run(server["id"], f"CPOOL-RPC ready {rpc['endpoint']}\n")
    assert coop.step()["reason"].startswith("head replica starting on n1")
    asyncio.run(coop.api.app.state.service_controller.run_once())
    [head] = [a for a in coop.api.ok("GET", "/api/v1/allocations")["items"] if a["name"] == "svc-big"]
    coop.run(head["id"])
    coop.exit(head["id"], code=3)  # the head saw its peer go first
    waiting = coop.step()
    assert waiting["status"] == "starting" and "checking its RPC servers" in waiting["reason"], waiting
    coop.exit(server["id"], code=137)
    out = coop.step()
    assert out["status"] == "replanning" and "RPC server on n2 failed" in out["reason"], out
    single = coop.step()
    assert [(s["node"], s["role"]) for s in single["shards"]] == [("n1", "head")], single
    n2 = next(c for c in single["candidates"] if c["node"] == "n2")
    assert n2["note"].startswith("excluded: RPC server on n2 failed"), n2


def test_a_head_failing_alone_replans_over_the_same_nodes(coop: Coop) -> None:
    import asyncio

    coop.join("n1")
    coop.join("n2")
    coop.peers("n1", "n2")
    coop.put(force_split=2)
    coop.step()
    measure(coop, {"n1": 60.0, "n2": 40.0})
    rpc = next(s for s in coop.step()["shards"] if s["role"] == "rpc")
    [server] = coop.coop_allocs("rpc")
    coop.run(server["id"], f"CPOOL-RPC ready {rpc['endpoint']}\n")
    coop.step()
    asyncio.run(coop.api.app.state.service_controller.run_once())
    [head] = [a for a in coop.api.ok("GET", "/api/v1/allocations")["items"] if a["name"] == "svc-big"]
    coop.run(head["id"])
    coop.exit(head["id"], code=1)
    assert "checking its RPC servers" in coop.step()["reason"]
    coop.advance(10.5)  # its RPC server outlives it by more than the grace
    out = coop.step()
    assert out["status"] == "replanning" and "head replica" in out["reason"], out
    # the spec the controller pinned to n1 does not keep n2 out of the next plan
    again = coop.step()
    assert sorted(s["node"] for s in again["shards"]) == ["n1", "n2"], again


def test_measurements_are_the_tenants_and_the_files(coop: Coop) -> None:
    coop.join("n1")
    coop.join("n2")
    coop.api.tenant("red")
    coop.api.tenant("blue")
    spec = {"request": {"cpu_milli": 1000}, "cooperative": {"model": "/m/tiny.gguf", "engine_python": PY}}

    def put(tenant: str) -> None:
        body = {"spec": spec, "tenant": tenant}
        assert coop.api.put(f"{S}/big", json=body, headers=coop.api.admin).status_code == 201

    def probes(tenant: str) -> list[dict[str, Any]]:
        return [a for a in coop.coop_allocs("probe") if a["tenant"] == tenant]

    put("blue")
    coop.step_only()
    for a in probes("blue"):  # blue's two nodes hold different files at the same path
        node = a["request"]["node_selector"]["cpool.io/node"]
        coop.run(a["id"], probe_line(20.0).replace("400000", "400000" if node == "n1" else "500000"))
        coop.exit(a["id"])
    coop.step_only()
    coop.step_only()
    # n1's file differs from the one measured last (n2's, by the tie's order): n1 is probed again
    blue = probes("blue")
    assert len(blue) == 3, blue
    retry = max(blue, key=lambda a: a["id"])
    assert retry["request"]["node_selector"]["cpool.io/node"] == "n1" and retry["state"] == "pending"
    # red's service on the same path measures its own file: blue's figures are not red's
    put("red")
    coop.step_only()
    assert len(probes("red")) == 2
    with coop.ctrl.db.read() as s:
        keys = set(s.scalars(select(CoopMeasurement.model_key)))
    assert len(keys) == 1 and next(iter(keys)).startswith("t"), keys


def test_an_excluded_node_is_used_again_after_a_minute_ready() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    st = State(excluded={"n2": "node lost"}, excluded_at={"n2": now.isoformat()})
    expire_exclusions(st, {"n1"}, now + timedelta(seconds=100), 60.0)  # n2 still away
    assert "n2" in st.excluded and "n2" not in st.ready_since
    expire_exclusions(st, {"n1", "n2"}, now + timedelta(seconds=110), 60.0)  # back: the clock starts
    assert "n2" in st.excluded
    expire_exclusions(st, {"n1", "n2"}, now + timedelta(seconds=150), 60.0)
    assert "n2" in st.excluded
    expire_exclusions(st, {"n1", "n2"}, now + timedelta(seconds=171), 60.0)
    assert st.excluded == {} and st.excluded_at == {} and st.ready_since == {}
