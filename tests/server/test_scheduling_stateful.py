"""Random interleavings of allocate / release / cancel / node join / node loss / scheduling cycles
(SQLite) keep the invariants: no device over capacity, exclusive slices alone, quota limits
held, and nothing submitted lost."""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from datetime import timedelta
from pathlib import Path

from harness import Api, TestClient
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from sqlalchemy import select, update

from computepool.server import ServerSettings, create_app
from computepool.store.db import db_now
from computepool.store.models import Allocation, Device, Node, Tenant

LIMITS = {"a": (2000, 4000), "b": (0, 3000)}  # (guaranteed, limit) gpu_milli
STATES = {"pending", "bound", "active", "released", "preempted", "failed", "cancelled"}


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="cpool-sm-"))
        app = create_app(ServerSettings(data_dir=self.dir, db_url=f"sqlite:///{self.dir / 'pool.db'}"))
        self.client = TestClient(app, raise_server_exceptions=False)
        self.client.__enter__()
        self.api = Api(app, self.client, app.state.settings)
        app.state.controller.auto = False
        self.headers: dict[str, dict[str, str]] = {}
        for t, (g, lim) in LIMITS.items():
            self.api.tenant(t)
            self.api.ok(
                "PUT", f"/api/v1/tenants/{t}/quota", json={"gpu_milli": {"guaranteed": g, "limit": lim}}
            )
            self.headers[t] = self.api.user(f"u{t}", t, "member")
        self.nodes: dict[str, dict[str, str]] = {}
        self.submitted: set[int] = set()

    def teardown(self) -> None:
        self.client.__exit__(None, None, None)
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(devices=st.integers(1, 3), mig=st.booleans())
    def join_node(self, devices: int, mig: bool) -> None:
        from test_allocations import join

        name = f"n{len(self.nodes)}"
        self.nodes[name] = join(self.api, name, devices, compute_milli=500 if mig else 1000, memory_mib=1000)

    @rule(
        tenant=st.sampled_from(["a", "b"]),
        gpus=st.integers(0, 2),
        milli=st.sampled_from([250, 500, 1000]),
        isolation=st.sampled_from([None, "exclusive", "mps", "mig"]),
        gang=st.integers(1, 2),
        restartable=st.booleans(),
        job=st.booleans(),
    )
    def allocate(
        self,
        tenant: str,
        gpus: int,
        milli: int,
        isolation: str | None,
        gang: int,
        restartable: bool,
        job: bool,
    ) -> None:
        body: dict[str, object] = {
            "gpus": gpus,
            "gang_nodes": gang,
            "restartable": restartable,
            "cpu_milli": 1000,
        }
        if gpus:
            body["gpu_milli"] = milli
        if isolation:
            body["isolation"] = isolation
        if job:
            body["command"] = ["true"]
        r = self.client.post("/api/v1/allocations", json=body, headers=self.headers[tenant])
        assert r.status_code in (201, 422), r.text  # 422: invalid or never holdable, never a 500
        if r.status_code == 201:
            self.submitted.add(r.json()["id"])

    @precondition(lambda self: self.submitted)
    @rule(data=st.data(), verb=st.sampled_from(["release", "cancel"]))
    def end(self, data: st.DataObject, verb: str) -> None:
        alloc_id = data.draw(st.sampled_from(sorted(self.submitted)))
        r = self.client.post(f"/api/v1/allocations/{alloc_id}/{verb}", headers=self.api.admin)
        assert r.status_code in (200, 409), r.text

    @precondition(lambda self: self.nodes)
    @rule(data=st.data())
    def lose_node(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.nodes)))
        with self.api.app.state.db.write() as s:
            s.execute(
                update(Node).where(Node.name == name).values(last_heartbeat_at=db_now(s) - timedelta(hours=1))
            )

    @precondition(lambda self: self.nodes)
    @rule(data=st.data())
    def node_returns(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.nodes)))
        self.api.ok("POST", f"/api/v1/nodes/{name}/heartbeat", headers=self.nodes[name])

    @rule()
    def schedule(self) -> None:
        assert self.api.app.state.controller.run_once().leader

    @invariant()
    def devices_within_capacity_and_exclusive_alone(self) -> None:
        with self.api.app.state.db.read() as s:
            caps = {
                (n, d.index): (d.compute_milli, d.memory_mib)
                for n, d in s.execute(select(Node.name, Device).join(Device, Device.node_id == Node.id)).all()
            }
            held = (
                s.scalars(select(Allocation).where(Allocation.state.in_(["bound", "active"]))).unique().all()
            )
            milli: Counter[tuple[str, int]] = Counter()
            mem: Counter[tuple[str, int]] = Counter()
            count: Counter[tuple[str, int]] = Counter()
            alone: set[tuple[str, int]] = set()
            mps: dict[tuple[str, int], set[int]] = {}  # tenants holding mps slices of a device
            for a in held:
                for sl in a.slices:
                    key = (sl["node"], sl["device_index"])
                    milli[key] += sl["compute_milli"]
                    mem[key] += sl["memory_mib"]
                    count[key] += 1
                    if sl["isolation"] in ("exclusive", "mig"):
                        alone.add(key)
                    if sl["isolation"] == "mps":
                        mps.setdefault(key, set()).add(a.tenant_id)
            for key in milli:
                assert milli[key] <= caps[key][0] and mem[key] <= caps[key][1], (key, milli[key], caps[key])
            for key in alone:
                assert count[key] == 1, f"exclusive slice on {key} shares its device"
            for key, tenants in mps.items():
                assert len(tenants) == 1, f"mps slices of two tenants on {key}"
            for a in held:
                assert len(set(a.nodes)) == a.request["gang_nodes"], "gang bound partly"

    @invariant()
    def quota_limits_hold(self) -> None:
        with self.api.app.state.db.read() as s:
            rows = s.execute(
                select(Tenant.name, Allocation.slices)
                .join(Tenant, Allocation.tenant_id == Tenant.id)
                .where(Allocation.state.in_(["bound", "active"]))
            ).all()
        used: Counter[str] = Counter()
        for tenant, slices in rows:
            used[tenant] += sum(sl["compute_milli"] for sl in slices)
        for tenant, (_g, lim) in LIMITS.items():
            assert used[tenant] <= lim, (tenant, used[tenant], lim)

    @invariant()
    def nothing_submitted_is_lost(self) -> None:
        with self.api.app.state.db.read() as s:
            rows = {a.id: a for a in s.scalars(select(Allocation)).unique().all()}
            assert self.submitted <= set(rows)
            for a in rows.values():
                assert a.state in STATES and a.attempt >= 1 and a.reason
                if a.state in ("released", "preempted", "failed", "cancelled"):
                    assert a.ended_at is not None
                if a.state == "pending":
                    assert a.slices == [] and a.nodes == []


PoolMachine.TestCase.settings = settings(
    max_examples=12,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_pool_invariants = PoolMachine.TestCase
