"""One line when the database goes away and one when it answers again — not a traceback for every
failed step of every background loop and a warning for every refused request.

`failed` is called wherever a database error is caught (a loop's step, an API call answered 503);
the first one of an outage logs it, with where and what. `answered` is called after a step that
worked; once no failure came for a second it logs how long the outage lasted, and the next failure
opens a new one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

log = logging.getLogger("computepool.server")

DB_DOWN = (OperationalError, InterfaceError, PoolTimeout)  # the database away, not a bug of ours
SQLITE_FULL = 13  # sqlite3's "database or disk is full"
SQLITE_IOERR = 10  # "disk I/O error": its extended codes say which call failed, not why
PG_DISK_FULL = "53100"  # PostgreSQL's disk_full SQLSTATE ("could not extend file ...")
NO_ROOM_BYTES = 1 << 16  # less free space than this beside the database: no write can get through


def disk_full(exc: BaseException, db_file: str | Path | None = None) -> bool:
    """Whether a database error says its disk is full: the write was refused whole (its
    transaction rolled back), and retrying helps only once an operator makes room.

    SQLite says "database or disk is full" when a write cannot grow its files, but a connection
    that must first make its shared-memory index (`-shm`) on a full disk fails with a plain "disk
    I/O error" (SQLITE_IOERR_SHMSIZE), reads included: with `db_file` (a SQLite database's path), an
    I/O error while the disk beside it has no room counts as full too."""
    orig = getattr(exc, "orig", None) or exc
    code = getattr(orig, "sqlite_errorcode", None)
    if code == SQLITE_FULL:
        return True
    if isinstance(code, int) and code & 0xFF == SQLITE_IOERR and db_file is not None:
        try:
            st = os.statvfs(Path(db_file).parent)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < NO_ROOM_BYTES
    return getattr(orig, "sqlstate", None) == PG_DISK_FULL


SETTLE_S = 1.0  # a success this long after the last failure closes the outage


class OutageNotes:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.since: float | None = None
        self._last_failure = 0.0
        self._failures = 0
        self._lock = threading.Lock()

    def failed(self, where: str, exc: BaseException) -> None:
        now = self.clock()
        with self._lock:
            self._last_failure = now
            self._failures += 1
            if self.since is not None:
                return
            self.since = now
        first = (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [""])[0][:300]
        log.warning(
            "database unavailable (%s, first seen by %s): %s; retrying — logged again once it answers",
            type(exc).__name__, where, first,
        )  # fmt: skip

    def answered(self) -> None:
        now = self.clock()
        with self._lock:
            if self.since is None or now - self._last_failure < SETTLE_S:
                return
            lasted, failures, self.since, self._failures = now - self.since, self._failures, None, 0
        log.warning(
            "database answers again after %.1f s (%d calls and steps failed meanwhile)", lasted, failures
        )
