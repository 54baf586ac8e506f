"""/metrics for Prometheus: who may read it, what heartbeats carry, node states, firing alerts,
and a scrape's cost not growing with the pool (SQLite and PostgreSQL)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from harness import Api, H
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import event, update
from test_allocations import alloc, cycle, join, manual

from computepool.server import ServerSettings
from computepool.server.metrics import PoolCollector
from computepool.store.db import Database
from computepool.store.migrate import upgrade
from computepool.store.models import Alert, Node

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, keyed by name and labels (Prometheus's own parser)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def scrape(api: Api, headers: H | None = None) -> Samples:
    r = api.get("/metrics", headers=headers or api.admin)
    assert r.status_code == 200, r.text
    return parse(r.text)


def series(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def dev(node: str, index: int, model: str = "A100") -> frozenset[tuple[str, str]]:
    return frozenset({"node": node, "device": str(index), "model": model}.items())


def beat(api: Api, node: str, headers: H, usage: list[dict[str, Any]]) -> None:
    api.ok("POST", f"/api/v1/nodes/{node}/heartbeat", headers=headers, json={"devices_usage": usage})


def test_scraper_reads_metrics_and_nothing_else_members_read_no_metrics(api: Api) -> None:
    api.tenant("acme")
    scraper = api.user("prom", "acme", "scraper")
    member = api.user("alice", "acme", "member")
    r = api.get("/metrics", headers=scraper)
    assert r.status_code == 200 and "cpool_device_capacity_milli" in r.text
    assert r.headers["content-type"].startswith("text/plain")
    assert api.get("/api/v1/allocations", headers=scraper).status_code == 403
    assert api.get("/api/v1/nodes", headers=scraper).status_code == 403
    assert api.post("/api/v1/allocations", json={"gpus": 1}, headers=scraper).status_code == 403
    assert api.get("/api/v1/whoami", headers=scraper).status_code == 200
    assert api.get("/metrics", headers=member).status_code == 403
    assert api.get("/metrics", headers={"Authorization": "Bearer cp_nope.nope"}).status_code == 401
    assert api.get("/metrics").status_code == 401


def test_heartbeat_telemetry_and_node_state_are_exported(api: Api) -> None:
    manual(api)
    n1 = join(api, "n1", devices=3)
    beat(
        api,
        "n1",
        n1,
        [
            {
                "index": 0,
                "used_memory_mib": 30000,
                "utilization_pct": 87.5,
                "power_w": 311.5,
                "energy_j": 9.5e6,
            },
            {"index": 1, "used_memory_mib": 0, "utilization_pct": 0.0, "power_w": 55.0, "energy_j": 12.0},
            # a MIG-like device: no utilization, no power; and unhealthy
            {"index": 2, "used_memory_mib": 100, "health": "nvmlDeviceGetMemoryInfo failed: GPU is lost"},
        ],
    )
    s = scrape(api)
    assert series(s, "cpool_device_utilization_percent") == {dev("n1", 0): 87.5, dev("n1", 1): 0.0}
    assert series(s, "cpool_device_memory_used_mib") == {
        dev("n1", 0): 30000.0,
        dev("n1", 1): 0.0,
        dev("n1", 2): 100.0,
    }
    assert series(s, "cpool_device_power_watts") == {dev("n1", 0): 311.5, dev("n1", 1): 55.0}
    assert series(s, "cpool_device_energy_joules") == {dev("n1", 0): 9.5e6, dev("n1", 1): 12.0}
    assert series(s, "cpool_device_healthy") == {dev("n1", 0): 1.0, dev("n1", 1): 1.0, dev("n1", 2): 0.0}
    states = {dict(k)["state"]: v for k, v in series(s, "cpool_node_state").items()}
    assert states == {"ready": 1.0, "suspect": 0.0, "lost": 0.0}
    (age,) = series(s, "cpool_node_heartbeat_age_seconds").values()
    assert 0.0 <= age < api.settings.suspect_after_s
    # a later heartbeat replaces what the first said
    beat(api, "n1", n1, [{"index": 2, "used_memory_mib": 0, "utilization_pct": 5.0, "power_w": 80.0}])
    s = scrape(api)
    assert series(s, "cpool_device_healthy")[dev("n1", 2)] == 1.0
    assert series(s, "cpool_device_power_watts")[dev("n1", 2)] == 80.0


def test_a_lost_nodes_last_readings_are_not_exported(api: Api) -> None:
    manual(api)
    n1 = join(api, "n1", devices=1)
    n2 = join(api, "n2", devices=1)
    join(api, "bare", devices=0)
    join(api, "bare2", devices=0)  # two of four silent: not so many that the brake holds
    for name, h in (("n1", n1), ("n2", n2)):
        beat(api, name, h, [{"index": 0, "used_memory_mib": 1, "utilization_pct": 50.0, "power_w": 200.0}])
    lost_at = datetime.now(UTC) - timedelta(seconds=api.settings.lost_after_s + 5)
    suspect_at = datetime.now(UTC) - timedelta(seconds=api.settings.suspect_after_s + 1)
    with api.app.state.db.write() as ses:
        ses.execute(update(Node).where(Node.name == "n2").values(last_heartbeat_at=lost_at))
        ses.execute(update(Node).where(Node.name == "bare").values(last_heartbeat_at=suspect_at))
    s = scrape(api)
    on = {k: v for k, v in series(s, "cpool_node_state").items() if v == 1.0}
    assert on == {
        frozenset({"node": "n1", "state": "ready"}.items()): 1.0,
        frozenset({"node": "n2", "state": "lost"}.items()): 1.0,
        frozenset({"node": "bare", "state": "suspect"}.items()): 1.0,
        frozenset({"node": "bare2", "state": "ready"}.items()): 1.0,
    }
    ages = {dict(k)["node"]: v for k, v in series(s, "cpool_node_heartbeat_age_seconds").items()}
    assert ages["n2"] >= api.settings.lost_after_s and ages["n1"] < api.settings.suspect_after_s
    assert set(series(s, "cpool_device_utilization_percent")) == {dev("n1", 0)}
    assert set(series(s, "cpool_device_healthy")) == {dev("n1", 0)}
    assert dev("n2", 0) in series(s, "cpool_device_capacity_milli")  # still the pool's, though lost


def test_allocated_and_used_side_by_side(api: Api) -> None:
    manual(api)
    n1 = join(api, "n1", devices=2)
    a = alloc(api, gpus=1)
    cycle(api)
    got = api.ok("GET", f"/api/v1/allocations/{a['id']}")
    held = int(got["slices"][0]["device_index"])
    beat(api, "n1", n1, [{"index": i, "used_memory_mib": 0, "utilization_pct": 0.0} for i in (0, 1)])
    s = scrape(api)
    assert series(s, "cpool_device_allocated_milli")[dev("n1", held)] == 1000.0
    assert series(s, "cpool_device_utilization_percent")[dev("n1", held)] == 0.0  # allocated, idle


# ---- firing alerts, straight from the alerts table ------------------------------------------


@pytest.fixture
def bare_db(db_url: str, tmp_path: Path) -> Iterator[tuple[Database, ServerSettings]]:
    """The pool's schema without a running app: nothing but the test writes alerts here."""
    settings = ServerSettings(data_dir=tmp_path / "data", db_url=db_url)
    db = Database(settings.database_url)
    upgrade(db)
    yield db, settings
    db.engine.dispose()


def collect(db: Database, settings: ServerSettings) -> Samples:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PoolCollector(db, settings))
    return parse(generate_latest(registry).decode())


def test_firing_alerts_are_counted_per_rule_and_listed_resolved_ones_are_not(
    bare_db: tuple[Database, ServerSettings],
) -> None:
    db, settings = bare_db
    assert series(collect(db, settings), "cpool_alerts_firing") == {}
    now = datetime.now(UTC)
    rows = [
        ("node-lost", "node n2", "critical", "firing"),
        ("node-lost", "node n3", "critical", "firing"),
        ("node-lost", "node n4", "critical", "resolved"),
        ("idle-devices", "allocation 7", "warning", "firing"),
        ("audit-chain-broken", "audit", "critical", "resolved"),
    ]
    with db.write() as s:
        for rule, subject, severity, state in rows:
            s.add(
                Alert(
                    rule=rule,
                    subject=subject,
                    tenant=None,
                    state=state,
                    severity=severity,
                    summary=f"{rule} {subject}",
                    detail={},
                    since=now,
                    resolved_at=now if state == "resolved" else None,
                )
            )
    s = collect(db, settings)

    def lab(**kw: str) -> frozenset[tuple[str, str]]:
        return frozenset(kw.items())

    assert series(s, "cpool_alerts_firing") == {
        lab(rule="node-lost", severity="critical"): 2.0,
        lab(rule="idle-devices", severity="warning"): 1.0,
    }
    assert series(s, "cpool_alert_firing") == {
        lab(rule="node-lost", subject="node n2", severity="critical"): 1.0,
        lab(rule="node-lost", subject="node n3", severity="critical"): 1.0,
        lab(rule="idle-devices", subject="allocation 7", severity="warning"): 1.0,
    }


def statements_per_scrape(db: Database, settings: ServerSettings) -> int:
    """SQL statements one scrape runs (this thread's only: the app's loops share the engine)."""
    me = threading.get_ident()
    count = 0

    def seen(*_: Any) -> None:
        nonlocal count
        if threading.get_ident() == me:
            count += 1

    event.listen(db.engine, "before_cursor_execute", seen)
    try:
        collect(db, settings)
    finally:
        event.remove(db.engine, "before_cursor_execute", seen)
    return count


def test_a_scrape_costs_the_same_whatever_the_pool_size(api: Api) -> None:
    manual(api)
    db: Database = api.app.state.db
    n = join(api, "n0", devices=1)
    beat(api, "n0", n, [{"index": 0, "used_memory_mib": 1, "utilization_pct": 1.0, "power_w": 60.0}])
    alloc(api, gpus=1)
    cycle(api)
    small = statements_per_scrape(db, api.settings)
    for i in range(1, 7):
        h = join(api, f"n{i}", devices=4)
        beat(api, f"n{i}", h, [{"index": d, "used_memory_mib": 1, "power_w": 60.0} for d in range(4)])
    for _ in range(3):
        alloc(api, gpus=1)
    cycle(api)
    big = statements_per_scrape(db, api.settings)
    assert big == small, (
        f"a scrape ran {small} statements with 1 device and 1 allocation, {big} with 25 and 4"
    )
    assert len(series(collect(db, api.settings), "cpool_device_power_watts")) == 25
