"""The chaos oracle's judgements on reports and database rows it is handed (real UDP for the
collector): it must see a second copy, an over-committed device and a shared exclusive slice, and
must not see one where attempts followed each other."""

from __future__ import annotations

import socket
import time

from computepool.chaos.oracle import CapacitySampler, Collector


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
