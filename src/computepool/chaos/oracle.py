"""What the chaos run checks, from outside the pool: jobs report themselves, the database is sampled.

- **One copy, ever.** Every job the workload submits runs `JOB` below: it sends "alive" over UDP to
  the run's collector every 0.2 s with its label, allocation, attempt, gang rank and pid, and
  "done" just before it exits 0; like a job that checkpoints, it takes 3 s to stop on SIGTERM.
  Two processes of one label and rank whose first-to-last reports overlap ran at once: a
  duplicate. A frozen copy says nothing while frozen, and its overlap shows the moment it is
  thawed and speaks again.
- **No device over capacity, no two tenants on an exclusive slice.** Every 0.5 s one query reads
  the bound and active allocations' slices in one snapshot of the database: per device the
  compute and memory held must fit, and an exclusive slice shares its device with nothing.
- **Nothing acknowledged lost, no healthy job failed.** At the end every allocation the API
  acknowledged is read back: it exists, it ended (or is still live when the run stopped short)
  with a reason, and a job that said "done" (exited 0) is not recorded failed — unless the
  reason is its node lost and a fault did silence that node (the pool cannot know better then;
  work that cannot restart runs on through the silence and may still exit 0) — nor run again
  after.
- **Times in order, on the control plane's clock.** Each allocation's `created_at`, `bound_at`,
  `started_at` and `ended_at`, where set, follow one another: a start reported by an agent is
  kept between the bind and the report's arrival, whatever the node's clock says.
- **The ledger books what was held.** Once the usage ledger's clock has passed the last end, each
  ended allocation's booked CPU- and GPU-seconds equal its share × bind-to-end (first attempts:
  a requeued one is booked per attempt, which the history does not pin down from outside).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg

# The job every chaos submission runs (argv: LABEL SECONDS COLLECTOR_PORT); stdlib only.
JOB = r"""
import os, signal, socket, sys, time
label, seconds, port = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
who = " ".join([label, os.environ.get("CPOOL_ALLOCATION_ID", "?"), os.environ.get("CPOOL_ATTEMPT", "?"),
                os.environ.get("NODE_RANK", "0"), str(os.getpid())])
def say(what):
    try:
        s.sendto((what + " " + who).encode(), ("127.0.0.1", port))
    except OSError:
        pass
end = time.monotonic() + seconds
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(time.monotonic()))
while time.monotonic() < end:
    if stopping and time.monotonic() - stopping[0] > 3:  # a checkpoint on SIGTERM takes a while
        sys.exit(143)
    say("alive")
    time.sleep(0.2)
say("done")
"""


@dataclass
class Copy:
    """One process of a job as its reports show it."""

    allocation: str
    attempt: str
    pid: str
    first: float
    last: float
    done: bool = False


@dataclass
class Collector:
    """The UDP endpoint the jobs report to, on loopback, on a port the kernel picked."""

    copies: dict[tuple[str, str], dict[str, Copy]] = field(default_factory=lambda: defaultdict(dict))
    done: dict[str, list[tuple[str, str]]] = field(default_factory=lambda: defaultdict(list))

    def __post_init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.5)
        self.port = int(self.sock.getsockname()[1])
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-collector", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                raw, _ = self.sock.recvfrom(512)
            except TimeoutError:
                continue
            except OSError:
                return
            self.note(raw.decode(errors="replace"), time.monotonic())

    def note(self, line: str, now: float) -> None:
        """One report, "alive|done LABEL ALLOCATION ATTEMPT RANK PID", heard at `now`."""
        f = line.split()
        if len(f) != 6 or f[0] not in ("alive", "done"):
            return
        what, label, alloc, attempt, rank, pid = f
        with self._lock:
            c = self.copies[(label, rank)].get(pid)
            if c is None:
                c = self.copies[(label, rank)][pid] = Copy(alloc, attempt, pid, now, now)
            c.last = now
            if what == "done":
                c.done = True
                self.done[label].append((attempt, rank))

    def duplicates(self) -> list[str]:
        """Labels and ranks with two processes whose report spans overlap."""
        out = []
        with self._lock:
            for (label, rank), by_pid in self.copies.items():
                spans = sorted(by_pid.values(), key=lambda c: c.first)
                for a, b in zip(spans, spans[1:], strict=False):
                    if b.first < a.last:
                        out.append(
                            f"two copies of {label} (allocation {a.allocation}, rank {rank}) ran at once: "
                            f"attempt {a.attempt} pid {a.pid} and attempt {b.attempt} pid {b.pid} "
                            f"overlapped {a.last - b.first:.1f} s"
                        )
        return out

    def finished(self, label: str) -> list[tuple[str, str]]:
        with self._lock:
            return list(self.done.get(label, []))

    def attempts(self, label: str) -> set[str]:
        with self._lock:
            return {
                c.attempt for (lb, _), by_pid in self.copies.items() if lb == label for c in by_pid.values()
            }

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(timeout=2)


class CapacitySampler:
    """Samples the held slices every `every_s` in one database snapshot (see the module)."""

    QUERY = "SELECT a.id, a.tenant_id, a.slices FROM allocations a WHERE a.state IN ('bound', 'active')"

    def __init__(self, dsn: str, every_s: float = 0.5, devices: dict[str, int] | None = None) -> None:
        self.dsn, self.every_s = dsn, every_s
        self.violations: list[str] = []
        self.samples = 0
        self._devices: dict[str, int] = dict(devices or {})  # uuid → memory MiB (read once if none)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-capacity", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while not self._stop.wait(self.every_s):
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=2)
                if not self._devices:
                    rows = conn.execute("SELECT uuid, memory_mib FROM devices").fetchall()
                    self._devices = {str(u): int(m) for u, m in rows}
                self.check(conn.execute(self.QUERY).fetchall())
            except psycopg.Error:  # the database is down (a fault): sample again when it is back
                with contextlib.suppress(Exception):
                    if conn is not None:
                        conn.close()
                conn = None

    def check(self, rows: list[tuple[Any, ...]]) -> None:
        self.samples += 1
        compute: dict[str, int] = defaultdict(int)
        memory: dict[str, int] = defaultdict(int)
        holders: dict[str, set[tuple[int, int, bool]]] = defaultdict(set)
        for alloc_id, tenant_id, slices in rows:
            for sl in slices or []:
                dev = str(sl["device_uuid"])
                compute[dev] += int(sl.get("compute_milli") or 0)
                memory[dev] += int(sl.get("memory_mib") or 0)
                holders[dev].add((int(alloc_id), int(tenant_id), sl.get("isolation") == "exclusive"))
        for dev, held in holders.items():
            why = []
            if compute[dev] > 1000:
                why.append(f"compute {compute[dev]}/1000 milli")
            if dev in self._devices and memory[dev] > self._devices[dev]:
                why.append(f"memory {memory[dev]}/{self._devices[dev]} MiB")
            if len(held) > 1 and any(ex for _, _, ex in held):
                why.append("an exclusive slice shared")
            if why:
                ids = sorted(a for a, _, _ in held)
                note = f"device {dev} over capacity ({', '.join(why)}) held by allocations {ids}"
                if note not in self.violations:
                    self.violations.append(note)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


TIMES = ("created_at", "bound_at", "started_at", "ended_at")


def time_order_violations(final: dict[int, dict[str, Any]]) -> list[str]:
    """Allocations (API objects by id) whose recorded times do not follow one another."""
    out = []
    for alloc_id, a in sorted(final.items()):
        seen = [(k, datetime.fromisoformat(str(a[k]))) for k in TIMES if a.get(k)]
        for (k1, t1), (k2, t2) in zip(seen, seen[1:], strict=False):
            if t2 < t1:
                out.append(f"allocation {alloc_id}: {k2} {t2.isoformat()} is before {k1} {t1.isoformat()}")
    return out


LEDGER_QUERY = """
SELECT a.id, a.request, a.nodes, a.slices, a.bound_at, a.ended_at,
       COALESCE(SUM(l.cpu_seconds), 0), COALESCE(SUM(l.gpu_seconds), 0)
FROM allocations a LEFT JOIN usage_ledger l ON l.allocation_id = a.id
WHERE a.attempt = 1 AND a.bound_at IS NOT NULL AND a.ended_at IS NOT NULL AND a.id = ANY(%s)
GROUP BY a.id
"""
LEDGER_TOLERANCE = 0.005  # float sums over many passes; a lost interval is far more than this


def ledger_mismatches(rows: Sequence[tuple[Any, ...]]) -> list[str]:
    """Rows of LEDGER_QUERY whose booked seconds are not share × bind-to-end."""
    out = []
    for alloc_id, request, nodes, slices, bound, ended, cpu_s, gpu_s in rows:
        held = (ended - bound).total_seconds()
        want = {
            "CPU": int((request or {}).get("cpu_milli") or 0) / 1000 * len(nodes or []) * held,
            "GPU": sum(int(sl.get("compute_milli") or 0) for sl in slices or []) / 1000 * held,
        }
        for what, booked in (("CPU", float(cpu_s)), ("GPU", float(gpu_s))):
            if abs(booked - want[what]) > LEDGER_TOLERANCE * want[what] + 0.01:
                out.append(
                    f"allocation {alloc_id}: the ledger booked {booked:.2f} {what}-seconds, "
                    f"its share × bind-to-end ({held:.2f} s) is {want[what]:.2f}"
                )
    return out


def ledger_violations(dsn: str, ids: Sequence[int], wait_s: float = 90) -> tuple[list[str], int]:
    """Wait for the ledger's clock to pass the last end of `ids`, then check them; (violations,
    allocations checked)."""
    deadline = time.monotonic() + wait_s
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        while True:
            last = conn.execute("SELECT max(ended_at) FROM allocations WHERE id = ANY(%s)", (list(ids),))
            last_end = last.fetchone()
            clock = conn.execute("SELECT at FROM ledger_clock").fetchone()
            end = last_end[0] if last_end else None
            if end is None or (clock is not None and clock[0] >= end):
                break
            if time.monotonic() > deadline:
                at = clock[0] if clock else None
                return [f"the usage ledger's clock ({at}) never passed the last end ({end})"], 0
            time.sleep(0.5)
        rows = conn.execute(LEDGER_QUERY, (list(ids),)).fetchall()
    return ledger_mismatches(rows), len(rows)
