"""The ledger's arithmetic: sums over ticks match what allocations held (property tests), energy
is conserved and split by share, booking adds on a real database, and the static equivalent of
a hand-computed history."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete

from computepool.server.ledger.accrual import (
    POOL_ALLOCATION,
    DeviceState,
    Holding,
    accrue,
    device_energy,
    hour_parts,
)
from computepool.server.ledger.static_equivalent import Interval, compare, intervals_of, peak, peak_devices
from computepool.store import migrate
from computepool.store import usage as sql
from computepool.store.db import Database
from computepool.store.models import UsageEntry

T0 = datetime(2026, 3, 1, 9, 40, tzinfo=UTC)
NODES = ("n1", "n2")
DEVICES = [(n, i) for n in NODES for i in range(2)]


def dev(node: str, index: int, **kw: object) -> DeviceState:
    base: dict[str, object] = {
        "model": "A100",
        "utilization_pct": 50.0,
        "power_w": None,
        "energy_j": None,
        "mark_j": None,
        "heard": True,
    }
    base.update(kw)
    return DeviceState(node, index, **base)  # type: ignore[arg-type]


slices_st = st.lists(st.tuples(st.sampled_from(DEVICES), st.sampled_from([125, 250, 500, 1000])), max_size=3)
holding_st = st.builds(
    lambda i, sl, cpu, mem: Holding(
        i, f"t{i % 3}", f"u{i}", f"job{i}", "", tuple((n, d, m) for (n, d), m in sl), (("n1", cpu, mem),)
    ),
    st.integers(1, 6),
    slices_st,
    st.integers(0, 8000),
    st.integers(0, 4096),
)
# where in the pass a holding starts and ends, as a fraction of it (None: before / after the pass)
edge_st = st.one_of(st.none(), st.floats(-0.5, 1.5))
tick_st = st.tuples(
    st.floats(0.5, 900.0),  # seconds
    st.lists(st.tuples(holding_st, edge_st, edge_st), max_size=4, unique_by=lambda h: h[0].id),
    st.dictionaries(st.sampled_from(DEVICES), st.floats(0.0, 100.0), max_size=4),  # utilization
)


def overlap(a: datetime, b: datetime, spans: list[tuple[datetime, datetime]]) -> float:
    """Seconds of [a, b) covered by the union of the spans."""
    cut = sorted((max(x, a), min(y, b)) for x, y in spans if min(y, b) > max(x, a))
    total, reach = 0.0, a
    for x, y in cut:
        if y > reach:
            total += (y - max(x, reach)).total_seconds()
            reach = y
    return total


@settings(max_examples=80, deadline=None)
@given(st.lists(tick_st, min_size=1, max_size=8), st.integers(0, 3599))
def test_ledger_sums_match_what_was_held(ticks: list[tuple[float, list[Any], dict]], offset: int) -> None:
    """Across passes that cross hours, with allocations starting and ending inside passes, Σ
    GPU-seconds is Σ share × time held, per allocation and in all; CPU likewise; every device's
    energy lands in exactly one place, and the pool gets exactly the stretches nobody held."""
    t = T0 + timedelta(seconds=offset)
    gpu: dict[int, float] = {}
    cpu: dict[int, float] = {}
    want_gpu: dict[int, float] = {}
    want_cpu: dict[int, float] = {}
    for seconds, drawn, util in ticks:
        end = t + timedelta(seconds=seconds)
        span = (end - t).total_seconds()
        holdings = [
            replace(
                h,
                since=None if a is None else t + timedelta(seconds=a * span),
                until=None if b is None else t + timedelta(seconds=b * span),
            )
            for h, a, b in drawn
        ]
        devices = [dev(n, i, utilization_pct=util.get((n, i)), power_w=100.0 + 10 * i) for n, i in DEVICES]
        book = accrue(t, end, holdings, devices)
        held_by_device: dict[tuple[str, int], list[tuple[datetime, datetime]]] = {}
        for h in holdings:
            since, until = h.since or t, h.until or end
            held_s = max(0.0, (min(until, end) - max(since, t)).total_seconds())
            want_gpu[h.id] = want_gpu.get(h.id, 0.0) + sum(m for _, _, m in h.slices) / 1000 * held_s
            want_cpu[h.id] = want_cpu.get(h.id, 0.0) + sum(c for _, c, _ in h.host) / 1000 * held_s
            for node, index, _ in h.slices:
                held_by_device.setdefault((node, index), []).append((since, until))
        pool: dict[str, float] = {}
        for (hour, alloc, node, _model), a in book.entries.items():
            assert hour <= end and hour + timedelta(hours=1) > t
            gpu[alloc] = gpu.get(alloc, 0.0) + a.gpu_seconds
            cpu[alloc] = cpu.get(alloc, 0.0) + a.cpu_seconds
            assert a.idle_waste_j <= a.energy_j + 1e-6
            if alloc == POOL_ALLOCATION:
                pool[node] = pool.get(node, 0.0) + a.energy_j
        booked = sum(a.energy_j for a in book.entries.values())
        assert booked == pytest.approx(sum(book.energy_by_device.values()), rel=1e-9)
        assert sum(book.energy_by_device.values()) == pytest.approx(
            sum((100.0 + 10 * i) * span for _, i in DEVICES), rel=1e-9
        )
        for node in NODES:
            free = sum(
                (100.0 + 10 * i) * (span - overlap(t, end, held_by_device.get((node, i), [])))
                for i in range(2)
            )
            assert pool.get(node, 0.0) == pytest.approx(free, rel=1e-6, abs=1e-6)
        t = end
    for alloc, want in want_gpu.items():
        assert gpu.get(alloc, 0.0) == pytest.approx(want, rel=1e-9, abs=1e-9)
    for alloc, want in want_cpu.items():
        assert cpu.get(alloc, 0.0) == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert set(gpu) - set(want_gpu) <= {POOL_ALLOCATION}


def test_a_job_shorter_than_a_pass_books_exactly_its_time() -> None:
    """Bound 3.21 s into the first of three 10 s passes, ended 1.79 s into the third: 18.58 s."""
    job = Holding(
        1, "a", "ann", "train", "", (("n1", 0, 1000),), (("n1", 2000, 0),),
        since=T0 + timedelta(seconds=3.21), until=T0 + timedelta(seconds=21.79),
    )  # fmt: skip
    total = 0.0
    cpu = 0.0
    for k in range(3):
        t = T0 + timedelta(seconds=10 * k)
        book = accrue(t, t + timedelta(seconds=10), [job], [dev("n1", 0, power_w=100.0)])
        total += sum(a.gpu_seconds for (_, alloc, _, _), a in book.entries.items() if alloc == 1)
        cpu += sum(a.cpu_seconds for a in book.entries.values())
    assert total == pytest.approx(18.58)
    assert cpu == pytest.approx(2 * 18.58)


def test_energy_is_split_by_who_held_the_device_when() -> None:
    """100 W for 10 s: a (half the device) holds 0–4 s, b (half) 2–10 s. 0–2: a alone 200 J; 2–4:
    shared 100 + 100 J; 4–10: b alone 600 J."""
    a = Holding(1, "a", "ann", "x", "", (("n1", 0, 500),), (), until=T0 + timedelta(seconds=4))
    b = Holding(2, "b", "bob", "y", "", (("n1", 0, 500),), (), since=T0 + timedelta(seconds=2))
    book = accrue(T0, T0 + timedelta(seconds=10), [a, b], [dev("n1", 0, power_w=100.0)])
    hour = T0.replace(minute=0)
    assert book.entries[(hour, 1, "n1", "A100")].energy_j == pytest.approx(300.0)
    assert book.entries[(hour, 2, "n1", "A100")].energy_j == pytest.approx(700.0)
    assert (hour, POOL_ALLOCATION, "n1", "A100") not in book.entries


def test_a_gap_books_all_time_the_counter_in_full_and_estimates_only_its_end() -> None:
    """Four hours unbooked: the holding books four hours; a device with a counter books its whole
    step; one with power only books its last 30 s (the cap), to whoever held it then."""
    end = T0 + timedelta(hours=4)
    h = Holding(1, "a", "ann", "x", "", (("n1", 0, 1000), ("n1", 1, 1000)), ())
    devices = [
        dev("n1", 0, energy_j=3.6e6 + 500.0, mark_j=500.0, power_w=50.0),  # 1 kWh over the gap
        dev("n1", 1, power_w=200.0),
    ]
    book = accrue(T0, end, [h], devices, slack_s=5.0, estimate_cap_s=30.0)
    assert sum(a.gpu_seconds for a in book.entries.values()) == pytest.approx(2 * 4 * 3600)
    assert book.energy_by_device == {("n1", 0): pytest.approx(3.6e6), ("n1", 1): pytest.approx(6000.0)}
    assert book.sources == {("n1", 0): "counter", ("n1", 1): "power"}
    last_hour = {k[0] for k, a in book.entries.items() if a.energy_j and k[0] >= end - timedelta(hours=1)}
    assert sum(a.energy_j for k, a in book.entries.items() if k[0] in last_hour) > 6000.0  # n1/1 at the end


def test_hours_are_split_at_the_boundary() -> None:
    parts = hour_parts(
        datetime(2026, 3, 1, 9, 59, 50, tzinfo=UTC), datetime(2026, 3, 1, 10, 0, 30, tzinfo=UTC)
    )
    assert parts == [
        (datetime(2026, 3, 1, 9, tzinfo=UTC), pytest.approx(0.25)),
        (datetime(2026, 3, 1, 10, tzinfo=UTC), pytest.approx(0.75)),
    ]


def test_energy_is_split_by_share_idle_is_waste_and_free_devices_go_to_the_pool() -> None:
    a = Holding(1, "a", "ann", "train", "", (("n1", 0, 250),), ())
    b = Holding(2, "b", "bob", "serve", "llm", (("n1", 0, 750), ("n1", 1, 1000)), ())
    devices = [
        dev("n1", 0, energy_j=5000.0, mark_j=2000.0, power_w=999.0),  # counter: 3000 J
        dev("n1", 1, utilization_pct=0.0, power_w=60.0),  # held, idle: 600 J of waste
        dev("n2", 0, utilization_pct=None),  # nothing reported: A100 model idle 55 W
        dev("n2", 1, power_w=300.0, heard=False),  # node lost: nothing booked
    ]
    book = accrue(T0, T0 + timedelta(seconds=10), [a, b], devices)
    hour = T0.replace(minute=0)
    e = book.entries
    assert e[(hour, 1, "n1", "A100")].energy_j == pytest.approx(750.0)
    assert e[(hour, 2, "n1", "A100")].energy_j == pytest.approx(2250.0 + 600.0)
    assert e[(hour, 2, "n1", "A100")].idle_waste_j == pytest.approx(600.0)
    assert e[(hour, 1, "n1", "A100")].idle_waste_j == 0.0
    assert e[(hour, 2, "n1", "A100")].gpu_seconds == pytest.approx(17.5)
    assert e[(hour, POOL_ALLOCATION, "n2", "A100")].energy_j == pytest.approx(550.0)
    assert book.sources == {("n1", 0): "counter", ("n1", 1): "power", ("n2", 0): "model", ("n2", 1): "none"}
    assert book.marks[("n1", 0)] == 5000.0
    assert book.labels[2].service == "llm"


@pytest.mark.parametrize(
    ("energy", "mark", "want", "source"),
    [
        (5000.0, 2000.0, 3000.0, "counter"),
        (1000.0, 2000.0, 1500.0, "power"),  # counter went back (driver reload): power × time
        (9e9, 0.0, 1500.0, "power"),  # implausible step
        (5000.0, None, 1500.0, "power"),  # first sight of the counter
    ],
)
def test_energy_source_order(energy: float, mark: float | None, want: float, source: str) -> None:
    d = dev("n1", 0, energy_j=energy, mark_j=mark, power_w=150.0)
    assert device_energy(d, 10.0) == (pytest.approx(want), source)


def test_a_counter_step_may_be_a_heartbeat_older_than_the_pass() -> None:
    """3000 W × (1 s + 5 s of slack) allows a 15 kJ step; without the slack it is implausible."""
    d = dev("n1", 0, energy_j=15_000.0, mark_j=0.0, power_w=150.0)
    assert device_energy(d, 1.0, slack_s=5.0) == (15_000.0, "counter")
    assert device_energy(d, 1.0) == (150.0, "power")


def test_a_mig_instance_is_modelled_as_its_share_of_the_board() -> None:
    """An A100 split 4g + 3g: no power per instance, so the model's idle 55 W is split 4:3."""
    four = dev("n1", 0, utilization_pct=0.0, board_share=4 / 7)
    three = dev("n1", 1, utilization_pct=0.0, board_share=3 / 7)
    joules = [device_energy(d, 7.0)[0] for d in (four, three)]
    assert joules == [pytest.approx(55.0 * 4), pytest.approx(55.0 * 3)]


# -- booking on a real database -----------------------------------------------------------------


@pytest.fixture(scope="module")
def ledger_db(tmp_path_factory: pytest.TempPathFactory) -> Database:
    path: Path = tmp_path_factory.mktemp("ledger") / "pool.db"
    db = Database(f"sqlite:///{path}")
    migrate.upgrade(db)
    return db


entry_st = st.builds(
    lambda h, alloc, node, model, g, j: sql.Entry(
        T0.replace(minute=0) + timedelta(hours=h), alloc, "t", "u", "j", "", node, model, g, 1.0, 2.0, j, 0.0
    ),
    st.integers(0, 2),
    st.integers(0, 3),
    st.sampled_from(NODES),
    st.sampled_from(["", "A100", "T4"]),
    st.floats(0, 1e5),
    st.floats(0, 1e7),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(entry_st, max_size=6), min_size=1, max_size=4))
def test_booking_adds_to_existing_rows(ledger_db: Database, batches: list[list[sql.Entry]]) -> None:
    with ledger_db.write() as s:
        s.execute(delete(UsageEntry))
    for batch in batches:
        with ledger_db.write() as s:
            sql.book(s, batch)
    since, until = T0.replace(minute=0), T0.replace(minute=0) + timedelta(hours=3)
    with ledger_db.read() as s:
        rows = sql.grouped(s, "model", since, until, None)
    got = {r["model"]: r["gpu_seconds"] for r in rows}
    want: dict[str, float] = {}
    for e in (e for b in batches for e in b):
        want[e.model] = want.get(e.model, 0.0) + e.gpu_seconds
    assert got.keys() == want.keys()
    for model, value in want.items():
        assert got[model] == pytest.approx(value, rel=1e-9, abs=1e-6)


# -- the static equivalent ----------------------------------------------------------------------


def at(minutes: int) -> datetime:
    return T0 + timedelta(minutes=minutes)


def test_static_equivalent_of_a_hand_computed_history() -> None:
    """Five A100s g0–g4 on n1 and a T4 on n2, no device ever over-full.
    a: g0+g1 whole 0–60, g2 whole 30–90 → peak 3 GPUs at 30 → 3 devices.
    b: 0.5 of g3 20–50, 0.25 of g3 40–70, 0.5 of g4 40–100 → 1.25 at 40–50 → 2 devices.
    d: 0.25 of g3 0–10 → 1 device. c: the T4 0–10, then again 10–20 (touching) → 1.
    The pool: A100s in use at once 0–10 {g0,g1,g3}, 20–30 {g0,g1,g3}, 30–40 + g2, 40–60 all five
    → peak 5; T4 1. Static: A100 3 + 2 + 1 = 6, T4 1."""
    g = {f"g{i}": ("n1", i) for i in range(5)}
    ivs = [
        Interval("a", "A100", at(0), at(60), 2000, frozenset({g["g0"], g["g1"]})),
        Interval("a", "A100", at(30), at(90), 1000, frozenset({g["g2"]})),
        Interval("b", "A100", at(20), at(50), 500, frozenset({g["g3"]})),
        Interval("b", "A100", at(40), at(70), 250, frozenset({g["g3"]})),
        Interval("b", "A100", at(40), at(100), 500, frozenset({g["g4"]})),
        Interval("d", "A100", at(0), at(10), 250, frozenset({g["g3"]})),
        Interval("c", "T4", at(0), at(10), 1000, frozenset({("n2", 0)})),
        Interval("c", "T4", at(10), at(20), 1000, frozenset({("n2", 0)})),
    ]
    cmp = compare(ivs, at(0), at(120))
    parts = {(p.tenant, p.model): (p.static_devices, p.peak_milli, p.peak_at) for p in cmp.partitions}
    assert parts == {
        ("a", "A100"): (3, 3000, at(30)),
        ("b", "A100"): (2, 1250, at(40)),
        ("c", "T4"): (1, 1000, at(0)),
        ("d", "A100"): (1, 250, at(0)),
    }
    assert cmp.pool_devices == {"A100": 5, "T4": 1}
    assert cmp.static_devices == {"A100": 6, "T4": 1}
    # a window cut at 35 min: a's peak of 3 from 30 min, b's 0.5 only; the pool's 4 A100s at 30–35
    cut = compare(ivs, at(0), at(35))
    assert {(p.tenant, p.static_devices) for p in cut.partitions} == {("a", 3), ("b", 1), ("c", 1), ("d", 1)}
    assert cut.pool_devices == {"A100": 4, "T4": 1}
    assert peak([]) == (0, 0, None)
    assert peak_devices([]) == 0


def test_sequential_jobs_on_different_devices_count_once_on_both_sides() -> None:
    """Four 1-GPU jobs one after another, each on another device: one device at a time, for the
    pool and for a static partition alike (nothing saved, nothing lost)."""
    ivs = [Interval("a", "A100", at(10 * k), at(10 * k + 10), 1000, frozenset({("n1", k)})) for k in range(4)]
    cmp = compare(ivs, at(0), at(60))
    assert cmp.pool_devices == {"A100": 1} and cmp.static_devices == {"A100": 1}


def test_an_earlier_attempt_counts_with_its_request() -> None:
    """Bound, active, requeued (its slices dropped), bound again on another device, released."""
    past = sql.Past(
        id=7,
        tenant="a",
        state="released",
        attempt=2,
        request={"gpus": 2, "gpu_milli": 500, "gang_nodes": 1},
        slices=[
            {"node": "n1", "device_index": 0, "compute_milli": 500},
            {"node": "n1", "device_index": 1, "compute_milli": 500},
        ],
        events=[
            (at(0), "pending", 1),
            (at(1), "bound", 1),
            (at(2), "active", 1),
            (at(10), "pending", 2),
            (at(20), "bound", 2),
            (at(21), "active", 2),
            (at(30), "released", 2),
        ],
    )
    got = list(intervals_of(past, {("n1", 0): "A100", ("n1", 1): "A100"}, at(60)))
    assert got == [
        Interval("a", "A100", at(1), at(10), 1000, frozenset({("attempt 7.1", 0), ("attempt 7.1", 1)})),
        Interval("a", "A100", at(20), at(30), 1000, frozenset({("n1", 0), ("n1", 1)})),
    ]
    still = sql.Past(7, "a", "active", 1, past.request, past.slices, past.events[:3])
    assert [(i.start, i.end) for i in intervals_of(still, {}, at(60))] == [(at(1), at(60))]
