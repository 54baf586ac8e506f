"""The background WAL checkpoint copies this process's commits into the database file, and an idle
server's checkpoint loop costs nothing when it has written nothing since the last complete one."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from sqlalchemy import event, text

from computepool.store import Database


def _checkouts(db: Database) -> list[int]:
    seen = [0]

    @event.listens_for(db.engine, "checkout")
    def _count(*_: Any) -> None:
        seen[0] += 1

    return seen


def _wal_frames(path: Path) -> tuple[int, int]:
    """(frames in the log, frames copied to the file), asked by another connection."""
    with sqlite3.connect(path) as other:
        busy, log, copied = other.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    assert busy == 0
    return log, copied


def test_checkpoint_runs_after_writes_only(tmp_path: Path) -> None:
    path = tmp_path / "wal-checkpoint.db"
    db = Database(f"sqlite:///{path}")
    try:
        with db.write() as s:
            s.execute(text("CREATE TABLE t (x INTEGER)"))
        seen = _checkouts(db)
        db.checkpoint()  # the first one always runs
        assert seen == [1]
        db.checkpoint()  # nothing written since a complete one: no connection, no pragma
        db.checkpoint()
        assert seen == [1]
        with db.write() as s:
            s.execute(text("INSERT INTO t VALUES (1)"))
        seen[0] = 0
        db.checkpoint()
        assert seen == [1]  # written since: it runs
        log, copied = _wal_frames(path)
        assert log == copied and log > 0  # the commit was copied into the file
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as ro:
            assert ro.execute("SELECT x FROM t").fetchall() == [(1,)]
    finally:
        db.dispose()


def test_checkpoint_is_a_no_op_on_a_read_only_process(tmp_path: Path) -> None:
    path = tmp_path / "wal-reader.db"
    db = Database(f"sqlite:///{path}")
    try:
        db.checkpoint()
        seen = _checkouts(db)
        with db.read() as s:
            assert s.execute(text("SELECT 1")).scalar() == 1
        db.checkpoint()
        assert seen == [1]  # the read's checkout only
    finally:
        db.dispose()
