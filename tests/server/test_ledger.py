"""The usage ledger through the real app (SQLite and PostgreSQL): heartbeats carrying power and
energy counters, ticks of the leader's Accountant at explicit times, usage grouped and priced,
tenant scoping, prices, device history, the static equivalent, and bad input."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from harness import Api
from sqlalchemy import event, func, select, update
from test_allocations import alloc, cycle, get, join, manual

from computepool.server.ledger import LedgerReport
from computepool.server.logic import usage as usage_service
from computepool.store import usage as sql
from computepool.store.db import db_now
from computepool.store.models import Allocation, Tenant

H = dict[str, str]
U = "/api/v1/usage"
INTERVAL = 600  # long ticks: figures large enough that six-digit rounding is no matter


def tick(api: Api, at: datetime) -> LedgerReport:
    """One pass of the ledger at `at`, after renewing the scheduling lease as the loop would."""
    api.app.state.controller.acquire()
    report: LedgerReport = api.app.state.accountant.run_once(at)
    return report


def beat(api: Api, node: str, headers: H, **device: Any) -> None:
    api.ok(
        "POST",
        f"/api/v1/nodes/{node}/heartbeat",
        headers=headers,
        json={"devices_usage": [{"index": 0, **device}]},
    )


def rows(api: Api, headers: H | None = None, **params: Any) -> list[dict[str, Any]]:
    return list(api.ok("GET", U, headers=headers, params=params)["items"])


def backdate(api: Api, alloc_id: int, bound_at: datetime) -> None:
    """As if the allocation had been bound at `bound_at`: the ledger's passes run at past times."""
    with api.app.state.db.write() as s:
        s.execute(update(Allocation).where(Allocation.id == alloc_id).values(bound_at=bound_at))


@pytest.fixture
def booked(make_api: Any) -> tuple[Api, H, datetime]:
    """Tenant default's 'train' (a quarter of n1's A100, 2 CPUs, 1 GiB) and acme's 'serve' (three
    quarters, 1 CPU, 2 GiB) for 1200 s, some six hours ago: 600 s at 300 W by the energy counter,
    then 600 s idle at 100 W; n2's T4 holds nothing and reports nothing (its model's idle 10 W, to
    the pool)."""
    api = make_api(ledger_interval_s=INTERVAL)
    api.app.state.accountant.auto = False
    manual(api)
    api.tenant("acme")
    member = api.user("mia", "acme", "member")
    n1 = join(api, "n1")
    a = alloc(api, name="train", gpus=1, gpu_milli=250, cpu_milli=2000, memory_mib=1024)
    b = alloc(api, member, name="serve", gpus=1, gpu_milli=750, cpu_milli=1000, memory_mib=2048)
    cycle(api)
    assert [get(api, x["id"])["state"] for x in (a, b)] == ["bound", "bound"]
    n2 = join(api, "n2", model="T4")
    start = datetime.now(UTC).replace(minute=5, second=0, microsecond=0) - timedelta(hours=6)
    for x in (a, b):
        backdate(api, x["id"], start)
    beat(api, "n1", n1, utilization_pct=60.0, power_w=300.0, energy_j=1000.0)
    beat(api, "n2", n2)
    assert tick(api, start) == LedgerReport(leader=True)  # bound at the first pass: nothing to book yet
    beat(api, "n1", n1, utilization_pct=60.0, power_w=300.0, energy_j=1000.0 + 180_000)
    assert tick(api, start + timedelta(seconds=INTERVAL)).booked_s == INTERVAL
    beat(api, "n1", n1, utilization_pct=0.0, power_w=100.0, energy_j=1000.0 + 240_000)
    tick(api, start + timedelta(seconds=2 * INTERVAL))
    return api, member, start


def test_usage_books_share_time_energy_by_share_and_idle_waste(booked: tuple[Api, H, datetime]) -> None:
    api, member, _ = booked
    by_tenant = {r["tenant"]: r for r in rows(api, by="tenant")}
    assert set(by_tenant) == {"default", "acme", "(pool)"}
    train, serve, pool = by_tenant["default"], by_tenant["acme"], by_tenant["(pool)"]
    assert train["gpu_hours"] == pytest.approx(0.25 * 1200 / 3600, abs=1e-6)
    assert serve["gpu_hours"] == pytest.approx(0.75 * 1200 / 3600, abs=1e-6)
    assert train["cpu_hours"] == pytest.approx(2 * 1200 / 3600, abs=1e-6)
    assert serve["memory_gib_hours"] == pytest.approx(2 * 1200 / 3600, abs=1e-6)
    assert train["energy_kwh"] == pytest.approx(0.25 * 240_000 / 3.6e6, abs=1e-6)
    assert serve["energy_kwh"] == pytest.approx(0.75 * 240_000 / 3.6e6, abs=1e-6)
    assert train["idle_waste_kwh"] == pytest.approx(0.25 * 60_000 / 3.6e6, abs=1e-6)
    assert serve["idle_waste_kwh"] == pytest.approx(0.75 * 60_000 / 3.6e6, abs=1e-6)
    assert pool["energy_kwh"] == pytest.approx(10.0 * 1200 / 3.6e6, abs=1e-6) and pool["gpu_hours"] == 0
    assert all(r["cost"] == 0 for r in by_tenant.values())
    assert api.ok("GET", U)["unpriced"] == ["A100", "energy-kwh"]
    # finer groupings add up to the same
    jobs = rows(api, by="job")
    assert {(r["tenant"], r["user"], r["job"]) for r in jobs} == {
        ("default", "admin", "train"),
        ("acme", "mia", "serve"),
        ("(pool)", "", ""),
    }
    assert sum(r["gpu_hours"] for r in jobs) == pytest.approx(1200 / 3600, abs=1e-5)
    models = {r["model"]: r for r in rows(api, by="model")}
    assert set(models) == {"A100", "T4", ""}  # "" is the host share (CPU, memory)
    assert models["A100"]["gpu_hours"] == pytest.approx(1200 / 3600, abs=1e-6)
    assert models[""]["cpu_hours"] == pytest.approx(3 * 1200 / 3600, abs=1e-6)
    # a member sees its tenant's rows only, and never the pool's
    assert [r["tenant"] for r in rows(api, member, by="tenant")] == ["acme"]
    assert {r["user"] for r in rows(api, member, by="user")} == {"mia"}
    assert {r["model"] for r in rows(api, member, by="model")} == {"A100", ""}
    # a window before the booking is empty
    assert rows(api, since="2020-01-01T00:00:00Z", until="2020-01-02T00:00:00Z") == []


def test_cost_from_a_known_price_table_and_prices_are_audited(booked: tuple[Api, H, datetime]) -> None:
    api, member, _ = booked
    assert api.ok("PUT", "/api/v1/prices/A100", json={"amount": 2.0})["amount"] == 2.0
    api.ok("PUT", "/api/v1/prices/energy-kwh", json={"amount": 0.3})
    api.ok("PUT", "/api/v1/prices/T4", json={"amount": 9.0})  # no GPU-hours on T4: costs nothing
    # a model no device is: stored (it may join later), but the answer says it applies to nothing
    typo = api.ok("PUT", "/api/v1/prices/A100-80GB", json={"amount": 2.5})
    assert "applies to nothing" in typo["warning"] and "did you mean A100?" in typo["warning"]
    assert api.ok("PUT", "/api/v1/prices/A100", json={"amount": 2.0})["warning"] == ""
    assert api.ok("PUT", "/api/v1/prices/energy-kwh", json={"amount": 0.3})["warning"] == ""
    api.ok("DELETE", "/api/v1/prices/A100-80GB")
    by_tenant = {r["tenant"]: r for r in rows(api)}
    assert by_tenant["default"]["cost"] == pytest.approx(
        0.25 * 1200 / 3600 * 2.0 + 60_000 / 3.6e6 * 0.3, abs=1e-5
    )
    assert by_tenant["acme"]["cost"] == pytest.approx(
        0.75 * 1200 / 3600 * 2.0 + 180_000 / 3.6e6 * 0.3, abs=1e-5
    )
    assert by_tenant["(pool)"]["cost"] == pytest.approx(12_000 / 3.6e6 * 0.3, abs=1e-5)
    assert api.ok("GET", U)["unpriced"] == []
    items = api.ok("GET", "/api/v1/prices", headers=member)["items"]
    assert [(p["item"], p["amount"]) for p in items] == [("A100", 2.0), ("T4", 9.0), ("energy-kwh", 0.3)]
    assert api.put("/api/v1/prices/A100", json={"amount": 1.0}, headers=member).status_code == 403
    assert api.ok("DELETE", "/api/v1/prices/T4")["item"] == "T4"
    assert api.delete("/api/v1/prices/T4", headers=api.admin).status_code == 404
    audit = api.ok("GET", "/api/v1/audit", params={"action": "price.set"})["items"]
    assert {r["target"] for r in audit if r["outcome"] == "ok"} == {
        "price:A100",
        "price:A100-80GB",
        "price:energy-kwh",
        "price:T4",
    }
    assert {r["outcome"] for r in audit} > {"ok"}  # the member's refused attempt is recorded too
    assert any(r["detail"].get("deleted") for r in audit)


def test_device_history(booked: tuple[Api, H, datetime]) -> None:
    api, member, start = booked
    points = api.ok("GET", "/api/v1/nodes/n1/history", headers=member, params={"since": "7h"})["items"]
    assert [p["at"][:19] for p in points] == [
        (start + timedelta(seconds=s)).isoformat()[:19] for s in (0, INTERVAL, 2 * INTERVAL)
    ]
    assert [p["power_w"] for p in points] == [300.0, 300.0, 100.0]
    assert [p["utilization_pct"] for p in points] == [60.0, 60.0, 0.0]
    assert api.ok("GET", "/api/v1/nodes/n1/history", params={"since": start.isoformat()})["items"] == points
    later = (start + timedelta(seconds=1)).isoformat()
    assert len(api.ok("GET", "/api/v1/nodes/n1/history", params={"since": later})["items"]) == 2
    r = api.get("/api/v1/nodes/nope/history", headers=api.admin)
    assert r.status_code == 404 and r.json()["error"] == "node 'nope' not found"


def test_a_long_gap_is_booked_in_full(booked: tuple[Api, H, datetime]) -> None:
    """Four hours without a leader: the use is known from bind times, so all four hours book; n1's
    last heartbeat is newer than the pass (heard) and its counter has not moved: no energy."""
    api, _, start = booked
    before = {r["tenant"]: r for r in rows(api)}
    report = tick(api, start + timedelta(seconds=2 * INTERVAL + 4 * 3600))
    assert report.booked_s == 4 * 3600
    after = {r["tenant"]: r for r in rows(api)}
    assert after["default"]["gpu_hours"] - before["default"]["gpu_hours"] == pytest.approx(0.25 * 4, abs=1e-5)
    assert after["acme"]["cpu_hours"] - before["acme"]["cpu_hours"] == pytest.approx(1 * 4, abs=1e-5)
    assert after["default"]["energy_kwh"] == before["default"]["energy_kwh"]
    # the T4 reports no power: its idle 10 W is estimated for the last 3 intervals only
    assert after["(pool)"]["energy_kwh"] - before["(pool)"]["energy_kwh"] == pytest.approx(
        10.0 * 3 * INTERVAL / 3.6e6, abs=1e-6
    )
    assert tick(api, start).booked_s == 0  # the clock never goes back


def test_the_ledger_books_no_further_than_a_transaction_still_open(api: Api) -> None:
    """A transaction that read the clock (as one ending an allocation does) and has not committed
    holds the ledger back to its start: booking past it could book past an end not yet visible."""
    db = api.app.state.db
    if db.dialect != "postgresql":
        pytest.skip("SQLite's writers take turns: no write is in flight while the ledger books")
    acc = api.app.state.accountant
    acc.auto = False
    manual(api)
    api.app.state.controller.acquire()
    assert acc.run_once().leader
    with db.write() as s:
        stamped = db_now(s)  # in flight: a report stamping an end with this time
        acc.run_once()
        with db.read() as r:
            held_back = sql.clock(r)
    assert held_back is not None and held_back <= stamped
    acc.run_once()
    with db.read() as r:
        moved = sql.clock(r)
    assert moved is not None and moved > stamped  # committed: the ledger catches up


def test_a_replica_without_the_lease_books_nothing(make_api: Any) -> None:
    leader, other = make_api(), make_api()
    for a in (leader, other):
        a.app.state.accountant.auto = False
        manual(a)
    leader.app.state.controller.acquire()
    other.app.state.controller.acquire()  # refused: the lease is held
    assert other.app.state.accountant.run_once() == LedgerReport(leader=False)
    assert leader.app.state.accountant.run_once() == LedgerReport(leader=True)


def test_static_equivalent_of_the_pools_own_history(api: Api) -> None:
    """default held two whole A100s at once, then released them; acme then held half of one.
    Static partitions: 2 + 1 = 3 devices; the pool had at most its 2 in use at once."""
    api.app.state.accountant.auto = False
    manual(api)
    api.tenant("acme")
    member = api.user("mia", "acme", "member")
    join(api, "n1", devices=2)
    xs = [alloc(api, gpus=1) for _ in range(2)]
    cycle(api)
    for x in xs:
        assert get(api, x["id"])["state"] == "bound"
        api.ok("POST", f"/api/v1/allocations/{x['id']}/release")
    y = alloc(api, member, gpus=1, gpu_milli=500)
    cycle(api)
    assert get(api, y["id"])["state"] == "bound"
    api.ok("PUT", "/api/v1/prices/A100", json={"amount": 1.5})
    out = api.ok("GET", f"{U}/static-equivalent")  # 30 days asked: clipped to the pool's minutes
    hours = (
        datetime.fromisoformat(out["until"]) - datetime.fromisoformat(out["since"])
    ).total_seconds() / 3600
    with api.app.state.db.read() as s:
        born = s.execute(select(func.min(Tenant.created_at))).scalar_one()
    assert out["clipped"] is True and datetime.fromisoformat(out["since"]) == born
    assert 0 < hours < 1
    assert (out["pool_devices"], out["static_devices"], out["devices_saved"]) == (2, 3, 1)
    assert out["devices_saved_pct"] == pytest.approx(33.33)
    assert out["cost_static"] - out["cost_pool"] == pytest.approx(1 * hours * 1.5, abs=2e-6)  # 6 digits
    assert out["energy_saved_kwh"] == pytest.approx(55.0 * hours / 1000, abs=2e-6)  # A100 idle 55 W
    parts = {(p["tenant"], p["model"]): (p["static_devices"], p["peak_gpus"]) for p in out["tenants"]}
    assert parts == {("default", "A100"): (2, 2.0), ("acme", "A100"): (1, 0.5)}
    assert out["models"] == {"A100": {"pool_devices": 2, "static_devices": 3, "pool_size_devices": 2}}
    assert out["pool_size_devices"] == 2 and out["energy_pool_includes_empty"] is True
    mine = api.ok("GET", f"{U}/static-equivalent", headers=member, params={"since": "1d"})
    assert [p["tenant"] for p in mine["tenants"]] == ["acme"]
    assert (mine["pool_devices"], mine["static_devices"]) == (1, 1)
    assert mine["energy_pool_includes_empty"] is False


def when(text: str) -> datetime:
    return datetime.fromisoformat(text)


def job_usage(api: Api, alloc_id: int) -> dict[str, Any]:
    [row] = [r for r in rows(api, by="job", since="2d") if r["allocation_id"] == alloc_id]
    return row


def test_an_allocation_ending_between_passes_books_to_its_end(make_api: Any) -> None:
    """Bound 5 s after a pass, released between two passes: it books exactly bind → release, GPU
    time and the device's energy alike; the pool gets the device's time before and after."""
    api = make_api(ledger_interval_s=INTERVAL)
    api.app.state.accountant.auto = False
    manual(api)
    n1 = join(api, "n1")
    beat(api, "n1", n1, utilization_pct=50.0, power_w=100.0)
    x = alloc(api, name="short", gpus=1, gpu_milli=500)
    cycle(api)
    b0 = datetime.now(UTC) - timedelta(seconds=1000)
    backdate(api, x["id"], b0)
    tick(api, b0 - timedelta(seconds=5))
    tick(api, b0 + timedelta(seconds=500))
    api.ok("POST", f"/api/v1/allocations/{x['id']}/release")
    ended = when(get(api, x["id"])["ended_at"])
    tick(api, ended + timedelta(seconds=7))
    held_h = (ended - b0).total_seconds() / 3600
    row = job_usage(api, x["id"])
    assert row["gpu_hours"] == pytest.approx(0.5 * held_h, abs=1e-6)
    assert row["energy_kwh"] == pytest.approx(100.0 * held_h / 1000, abs=1e-6)  # its alone while held
    pool = {r["tenant"]: r for r in rows(api, since="2d")}["(pool)"]
    assert pool["energy_kwh"] == pytest.approx(100.0 * 12 / 3.6e6, abs=1e-6)  # 5 s before, 7 s after


def test_a_requeued_attempt_books_up_to_its_requeue(api: Api) -> None:
    """Seen held at a pass, then lost by its agent and requeued (its slices dropped): the next pass
    books the attempt up to the requeue, from what the ledger saw held."""
    api.app.state.accountant.auto = False
    manual(api)
    n1 = join(api, "n1")
    x = alloc(api, name="retry", gpus=1, command=["sleep", "1000"], restartable=True)
    cycle(api)
    b0 = datetime.now(UTC) - timedelta(seconds=1000)
    backdate(api, x["id"], b0)
    tick(api, b0 - timedelta(seconds=5))
    tick(api, b0 + timedelta(seconds=500))
    lost = {"allocation_id": x["id"], "attempt": 1, "state": "lost", "reason": "agent restart"}
    api.ok("POST", "/api/v1/nodes/n1/reports", headers=n1, json={"reports": [lost]})
    got = get(api, x["id"])
    assert got["state"] == "pending" and got["attempt"] == 2
    requeued = when(got["events"][-1]["at"])
    tick(api, requeued + timedelta(seconds=30))
    assert job_usage(api, x["id"])["gpu_hours"] == pytest.approx(
        (requeued - b0).total_seconds() / 3600, abs=1e-6
    )


def test_history_is_sampled_once_a_minute_and_thinned_in_the_database(api: Api) -> None:
    api.app.state.accountant.auto = False
    manual(api)
    join(api, "n1", devices=2)
    t = datetime.now(UTC) - timedelta(days=3)
    for k in (0, 10, 50, 70):  # passes at 0, 10, 50 and 70 s: samples at 0 and 70 only
        tick(api, t + timedelta(seconds=k))
    points = api.ok("GET", "/api/v1/nodes/n1/history", params={"since": "4d"})["items"]
    assert [p["at"][:19] for p in points if p["device_index"] == 0] == [
        (t + timedelta(seconds=k)).isoformat()[:19] for k in (0, 70)
    ]
    # two days of minutes on both devices: 2881 samples each, thinned to every 5th (≤ 720)
    with api.app.state.db.write() as s:
        devs = sql.devices(s)
        for m in range(1, 2 * 24 * 60):
            sql.add_samples(s, t + timedelta(seconds=70 + 60 * m), devs)
    points = api.ok("GET", "/api/v1/nodes/n1/history", params={"since": "4d"})["items"]
    for index in (0, 1):
        mine = [when(p["at"]) for p in points if p["device_index"] == index]
        assert len(mine) == 577 and mine[0] == t
        assert mine[-1] == t + timedelta(seconds=70 + 60 * (2 * 24 * 60 - 1))  # the latest shows
        assert {b - a for a, b in zip(mine[1:], mine[2:], strict=False)} == {timedelta(minutes=5)}


def test_by_job_is_limited_and_says_so(api: Api) -> None:
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    n = usage_service.MAX_JOB_ROWS + 1
    with api.app.state.db.write() as s:
        sql.book(
            s,
            [
                sql.Entry(hour, i, "default", "u", "j", "", "n1", "A100", 1.0, 0, 0, 0, 0)
                for i in range(1, n + 1)
            ],
        )
    out = api.ok("GET", U, params={"by": "job", "since": "1d"})
    assert out["truncated"] is True and len(out["items"]) == usage_service.MAX_JOB_ROWS
    assert out["items"][-1]["allocation_id"] == n  # the newest are kept
    assert api.ok("GET", U, params={"by": "tenant", "since": "1d"})["truncated"] is False


def test_until_is_clamped_to_now(api: Api) -> None:
    out = api.ok("GET", f"{U}/static-equivalent", params={"until": "2099-01-01T00:00:00Z"})
    assert when(out["until"]) <= datetime.now(UTC)


BAD = [
    ("GET", f"{U}?by=team", None, 422, "by"),
    ("GET", f"{U}?since=yesterday", None, 422, "since"),
    ("GET", f"{U}?since=1h&until=2h", None, 422, "until"),
    ("GET", f"{U}/static-equivalent?since=99999999d", None, 422, "since"),
    ("GET", "/api/v1/nodes/n1/history?since=soon", None, 422, "since"),
    ("GET", "/api/v1/nodes/n9/history", None, 404, None),
    ("PUT", "/api/v1/prices/A100", {"amount": -1}, 422, "amount"),
    ("PUT", "/api/v1/prices/A100", {"amount": 1, "currency": "EUR"}, 422, "currency"),
    ("PUT", "/api/v1/prices/bad%20name", {"amount": 1}, 422, "item"),
    ("DELETE", "/api/v1/prices/nothing", None, 404, "item"),
]


def test_bad_input_is_4xx_naming_the_parameter(api: Api) -> None:
    join(api, "n1")
    for method, path, body, status, field in BAD:
        r = api.request(method, path, json=body, headers=api.admin)
        assert r.status_code == status, (path, r.text)
        assert r.json().get("field") == field, (path, r.json())
    assert api.get(U).status_code == 401  # no token
    assert api.get(f"{U}/static-equivalent").status_code == 401


def test_energy_marks_are_set_in_one_statement(api: Api) -> None:
    """Every device's mark in one executemany: a large pool's pass stays short under the lock."""
    join(api, "n1", devices=8)
    db = api.app.state.db
    with db.read() as s:
        ids = [d.id for d in sql.devices(s)]
    calls: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if "energy_mark_j" in statement:
            calls.append(statement)

    event.listen(db.engine, "before_cursor_execute", count)
    try:
        with db.write() as s:
            sql.set_marks(s, {i: 1000.0 + i for i in ids})
    finally:
        event.remove(db.engine, "before_cursor_execute", count)
    assert len(calls) == 1
    with db.read() as s:
        assert {d.id: d.mark_j for d in sql.devices(s)} == {i: 1000.0 + i for i in ids}
