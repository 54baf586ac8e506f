"""The chaos oracle's judgements on reports and database rows it is handed (real UDP for the
collector): it must see a second copy, an over-committed device, a shared exclusive slice and a
ledger that booked other than share × bind-to-end, and must not see one where attempts followed
each other."""

from __future__ import annotations

import socket
import time
from datetime import UTC, datetime, timedelta

from computepool.chaos.oracle import CapacitySampler, Collector, ledger_mismatches, time_order_violations


def test_overlapping_copies_are_duplicates_and_successive_attempts_are_not() -> None:
    c = Collector()
    try:
        c.note("alive j1 7 1 0 100", 10.0)
        c.note("alive j1 7 1 0 100", 11.0)
        c.note("alive j1 7 2 0 200", 11.5)  # attempt 2 before attempt 1's last report
        c.note("alive j1 7 1 0 100", 12.0)  # a thawed copy speaking again
        c.note("alive j2 8 1 0 300", 10.0)
        c.note("alive j2 8 1 0 300", 11.0)
        c.note("alive j2 8 2 0 301", 11.2)  # after the first copy's end: fine
        c.note("alive j3 9 1 0 400", 10.0)  # a gang: ranks 0 and 1 at once, fine
        c.note("alive j3 9 1 1 500", 10.0)
        c.note("done j3 9 1 1 500", 10.5)
        c.note("bogus", 10.0)
        dups = c.duplicates()
        assert len(dups) == 1 and "two copies of j1 (allocation 7, rank 0)" in dups[0], dups
        assert "attempt 1 pid 100 and attempt 2 pid 200" in dups[0]
        assert c.finished("j3") == [("1", "1")] and c.attempts("j2") == {"1", "2"}
    finally:
        c.close()


def test_the_collector_hears_jobs_over_udp() -> None:
    c = Collector()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"done j9 3 1 0 42", ("127.0.0.1", c.port))
        deadline = time.monotonic() + 30
        while not c.finished("j9") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.finished("j9") == [("1", "0")]
    finally:
        c.close()


def slice_(dev: str, milli: int, mem: int, isolation: str = "timeslice") -> dict[str, object]:
    return {"device_uuid": dev, "compute_milli": milli, "memory_mib": mem, "isolation": isolation}


def test_capacity_over_commits_and_shared_exclusive_slices_are_violations() -> None:
    s = CapacitySampler("unused", devices={"GPU-a": 1000, "GPU-b": 1000, "GPU-c": 1000})
    s.check(
        [
            (1, 1, [slice_("GPU-a", 500, 400), slice_("GPU-b", 1000, 1000, "exclusive")]),
            (2, 2, [slice_("GPU-a", 500, 600)]),  # GPU-a exactly full: fine
            (3, 2, [slice_("GPU-c", 600, 100)]),
        ]
    )
    assert s.violations == [] and s.samples == 1
    s.check([(1, 1, [slice_("GPU-b", 1000, 1000, "exclusive")]), (4, 2, [slice_("GPU-b", 0, 0)])])
    s.check([(2, 2, [slice_("GPU-a", 700, 600)]), (5, 1, [slice_("GPU-a", 400, 500)])])
    assert s.violations == [
        "device GPU-b over capacity (an exclusive slice shared) held by allocations [1, 4]",
        "device GPU-a over capacity (compute 1100/1000 milli, memory 1100/1000 MiB) held by allocations "
        "[2, 5]",
    ]


def test_the_ledger_must_book_share_times_bind_to_end() -> None:
    t0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    rows = [
        # half a GPU and 2 CPUs for 20.5 s, booked exactly
        (
            1,
            {"cpu_milli": 2000},
            ["n1"],
            [slice_("GPU-a", 500, 0)],
            t0,
            t0 + timedelta(seconds=20.5),
            41.0,
            10.25,
        ),
        # a gang's CPU share on each of its two nodes
        (2, {"cpu_milli": 500}, ["n1", "n2"], [], t0, t0 + timedelta(seconds=10), 10.0, 0.0),
        # the first interval lost: 20.5 s held, 11.9 s booked
        (3, {"cpu_milli": 0}, ["n1"], [slice_("GPU-b", 500, 0)], t0, t0 + timedelta(seconds=20.5), 0.0, 5.95),
        # booked twice
        (4, {"cpu_milli": 1000}, ["n2"], [], t0, t0 + timedelta(seconds=5), 10.0, 0.0),
    ]
    wrong = ledger_mismatches(rows)
    assert wrong == [
        "allocation 3: the ledger booked 5.95 GPU-seconds, its share × bind-to-end (20.50 s) is 10.25",
        "allocation 4: the ledger booked 10.00 CPU-seconds, its share × bind-to-end (5.00 s) is 5.00",
    ]


def test_times_must_follow_one_another() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    at = {
        k: (t0 + timedelta(seconds=i)).isoformat()
        for i, k in enumerate(("created_at", "bound_at", "started_at", "ended_at"))
    }
    early = at | {
        "started_at": (t0 - timedelta(minutes=10)).isoformat()
    }  # an agent's clock, ten minutes slow
    pending = {"created_at": at["created_at"], "bound_at": None, "started_at": None, "ended_at": None}
    assert time_order_violations({1: at, 2: pending}) == []
    assert time_order_violations({3: early}) == [
        "allocation 3: started_at 2025-12-31T23:50:00+00:00 is before bound_at 2026-01-01T00:00:01+00:00"
    ]
