"""The agent's own record of what it runs, in SQLite in its data dir.

It outlives the agent process: a restarted agent re-adopts workloads that still run (same pid
*and* same process start time, so a reused pid is never mistaken for our job) and reports those
that ended while it, or the control plane, was away.

An attempt's row is kept until the control plane has acknowledged its end *and* no longer assigns
it (the agent then `forget`s it): what the agent reads on every pass are the open rows alone (running,
or ended and not yet acknowledged), found through an index, so its work per pass follows the jobs
it runs now, never how many it ever ran. The tenants it has served are kept apart (`tenants()`).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any


class JobState(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"  # non-zero exit, signal, out of memory, or could not start
    KILLED = "killed"  # stopped on purpose (by the agent, the watchdog or the control plane)
    LOST = "lost"  # ended while the agent was away and left no exit status

    @property
    def ended(self) -> bool:
        return self is not JobState.RUNNING


def job_key(allocation_id: str, attempt: int) -> str:
    return f"{allocation_id}#{attempt}"


@dataclass
class JobRecord:
    """One attempt of one allocation on this node. Times are Unix seconds."""

    allocation_id: str
    attempt: int
    command: list[str]
    run_dir: str
    state: JobState = JobState.RUNNING
    pid: int = 0
    pgid: int = 0
    create_time: float = 0.0
    exit_code: int | None = None
    reason: str = ""
    started_at: float = 0.0
    ended_at: float | None = None
    limits: str = ""  # how CPU and host memory are held, in words
    cgroup: str = ""
    memory_mib: int = 0
    stop_reason: str = ""  # set when a stop was asked; survives an agent restart
    reported: bool = False  # the control plane has acknowledged the end
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return job_key(self.allocation_id, self.attempt)


_COLUMNS = [f.name for f in fields(JobRecord)]
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS jobs (
    key TEXT PRIMARY KEY,
    {", ".join(f"{c} TEXT" for c in _COLUMNS)}
)
"""
# Columns hold JSON text: an open row (running, or ended and unacknowledged) has reported 'false'.
_OPEN = "reported = 'false'"
_RUNNING = json.dumps(JobState.RUNNING.value)
_VERSION = 1  # PRAGMA user_version: 1 adds the open-rows index and the tenants table
_UPGRADE = [
    f"CREATE INDEX IF NOT EXISTS jobs_open ON jobs(key) WHERE {_OPEN}",
    "CREATE TABLE IF NOT EXISTS tenants (name TEXT PRIMARY KEY)",
    # the tenants of the rows written before the table was (once, when it is made)
    "INSERT OR IGNORE INTO tenants SELECT json_extract(extra, '$.tenant') FROM jobs"
    " WHERE json_extract(extra, '$.tenant') IS NOT NULL",
]


def _encode(rec: JobRecord) -> list[str | None]:
    out: list[str | None] = [rec.key]
    for c in _COLUMNS:
        v = getattr(rec, c)
        out.append(None if v is None else json.dumps(v))
    return out


def _decode(row: sqlite3.Row) -> JobRecord:
    values: dict[str, Any] = {c: (None if row[c] is None else json.loads(row[c])) for c in _COLUMNS}
    values["state"] = JobState(values["state"])
    return JobRecord(**values)


def _sorted(recs: Iterable[JobRecord]) -> list[JobRecord]:
    return sorted(recs, key=lambda r: (r.started_at, r.key))


class LocalState:
    """Job records keyed by `allocation#attempt`; safe to share between the agent's threads.

    `rows_read` counts the records decoded since it opened: what a pass of the agent costs here."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = data_dir / "agent-state.db"
        # created 0600 before SQLite opens it: its -wal and -shm files take the same mode
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600))
        os.chmod(self.path, 0o600)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        self._tenants: set[str] = set()
        self.rows_read = 0
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(_SCHEMA)
            if self._db.execute("PRAGMA user_version").fetchone()[0] < _VERSION:
                self._db.execute("BEGIN IMMEDIATE")
                for statement in _UPGRADE:
                    self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version = {_VERSION}")
                self._db.execute("COMMIT")
            self._tenants = {r[0] for r in self._db.execute("SELECT name FROM tenants")}

    def put(self, rec: JobRecord) -> None:
        marks = ", ".join("?" * (len(_COLUMNS) + 1))
        tenant = rec.extra.get("tenant", "")
        with self._lock:
            self._db.execute(
                f"INSERT OR REPLACE INTO jobs (key, {', '.join(_COLUMNS)}) VALUES ({marks})", _encode(rec)
            )
            if tenant and tenant not in self._tenants:
                self._db.execute("INSERT OR IGNORE INTO tenants (name) VALUES (?)", (tenant,))
                self._tenants.add(tenant)

    def get(self, key: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE key = ?", (key,)).fetchone()
        return None if row is None else self._decoded([row])[0]

    def known(self, key: str) -> bool:
        """Whether this attempt has a record here (it ran, or was tried, on this node)."""
        with self._lock:
            return self._db.execute("SELECT 1 FROM jobs WHERE key = ?", (key,)).fetchone() is not None

    def _decoded(self, rows: list[sqlite3.Row]) -> list[JobRecord]:
        self.rows_read += len(rows)
        return [_decode(r) for r in rows]

    def _open(self, where: str = "") -> list[JobRecord]:
        """The open rows (running, or ended and unacknowledged), through the index: never the rest."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT * FROM jobs INDEXED BY jobs_open WHERE {_OPEN}{where}"
            ).fetchall()
        return _sorted(self._decoded(rows))

    def jobs(self, states: Iterable[JobState] | None = None) -> list[JobRecord]:
        """Every record kept, acknowledged ones included (reads the whole table: not for each pass)."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs").fetchall()
        wanted = None if states is None else set(states)
        return _sorted(r for r in self._decoded(rows) if wanted is None or r.state in wanted)

    def running(self) -> list[JobRecord]:
        return self._open(f" AND state = '{_RUNNING}'")

    def open_jobs(self) -> list[JobRecord]:
        """Running, or ended and not yet acknowledged: what an agent that starts takes up again."""
        return self._open()

    def unreported(self) -> list[JobRecord]:
        """Ended attempts the control plane has not acknowledged yet."""
        return self._open(f" AND state != '{_RUNNING}'")

    def acknowledged(self) -> list[str]:
        """The keys of the ended attempts the control plane has acknowledged and that are still kept."""
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT key FROM jobs WHERE reported = 'true'")]

    def tenants(self) -> set[str]:
        """Every tenant whose job this node has run or tried (forgotten records included)."""
        with self._lock:
            return set(self._tenants)

    def mark_reported(self, key: str) -> None:
        with self._lock:
            self._db.execute(
                f"UPDATE jobs SET reported = 'true' WHERE key = ? AND state != '{_RUNNING}'", (key,)
            )

    def forget(self, key: str) -> None:
        self.forget_many([key])

    def forget_many(self, keys: Iterable[str]) -> None:
        with self._lock:
            self._db.executemany("DELETE FROM jobs WHERE key = ?", [(k,) for k in keys])

    def close(self) -> None:
        with self._lock:
            self._db.close()
