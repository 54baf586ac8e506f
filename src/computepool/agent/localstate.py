"""The agent's own record of what it runs, in SQLite in its data dir.

It outlives the agent process: a restarted agent re-adopts workloads that still run (same pid
*and* same process start time, so a reused pid is never mistaken for our job) and reports those
that ended while it, or the control plane, was away.
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


class LocalState:
    """Job records keyed by `allocation#attempt`; safe to share between the agent's threads."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = data_dir / "agent-state.db"
        # created 0600 before SQLite opens it: its -wal and -shm files take the same mode
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600))
        os.chmod(self.path, 0o600)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(_SCHEMA)

    def put(self, rec: JobRecord) -> None:
        marks = ", ".join("?" * (len(_COLUMNS) + 1))
        with self._lock:
            self._db.execute(
                f"INSERT OR REPLACE INTO jobs (key, {', '.join(_COLUMNS)}) VALUES ({marks})", _encode(rec)
            )

    def get(self, key: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE key = ?", (key,)).fetchone()
        return None if row is None else _decode(row)

    def jobs(self, states: Iterable[JobState] | None = None) -> list[JobRecord]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs").fetchall()
        wanted = None if states is None else set(states)
        recs = [_decode(r) for r in rows]
        return sorted(
            (r for r in recs if wanted is None or r.state in wanted), key=lambda r: (r.started_at, r.key)
        )

    def running(self) -> list[JobRecord]:
        return self.jobs([JobState.RUNNING])

    def unreported(self) -> list[JobRecord]:
        """Ended attempts the control plane has not acknowledged yet."""
        return [r for r in self.jobs() if r.state.ended and not r.reported]

    def mark_reported(self, key: str) -> None:
        rec = self.get(key)
        if rec is not None and rec.state.ended:
            rec.reported = True
            self.put(rec)

    def forget(self, key: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE key = ?", (key,))

    def close(self) -> None:
        with self._lock:
            self._db.close()
