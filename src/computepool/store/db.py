"""The engine and its sessions: SQLite (WAL, foreign keys) by default, PostgreSQL for replicas.

`Database.write()` opens a transaction that takes the write lock up front on SQLite
(`BEGIN IMMEDIATE`): a deferred transaction that reads first and writes later fails with
SQLITE_BUSY when another writer committed in between, and no busy timeout can save it.
PostgreSQL needs no such care; row locks (`SELECT … FOR UPDATE`) serialise where it matters.

On SQLite the writers of one process also queue on a lock of their own before `BEGIN
IMMEDIATE`: SQLite's busy handler waits by sleeping in growing steps (up to 100 ms), so under
concurrent writers most of a request's time went to sleeping while the lock sat free. Other
processes writing the same file still meet the busy timeout.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from computepool.store.audit import AUDIT_KEY_INFO

SQLITE_BUSY_TIMEOUT_S = 15
SQLITE_POOL_SIZE = 48
PG_POOL_SIZE = 20
PG_CONNECT_TIMEOUT_S = 3


def _private_sqlite_file(url: str) -> None:
    """The database file readable by its owner only (0600). Made before SQLite opens it, since its
    -wal and -shm files take the main file's mode; files of an older start are narrowed too."""
    name = make_url(url).database
    if not name or name == ":memory:" or name.startswith("file:"):
        return
    path = Path(name)
    if path.parent.is_dir():
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    for f in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with suppress(FileNotFoundError):
            os.chmod(f, 0o600)


def _sqlite_engine(url: str) -> Engine:
    _private_sqlite_file(url)
    # Every worker thread (the API's pool has 40) may hold a connection at once: a pool smaller
    # than that makes requests queue for connections, and overflow ones are opened and closed
    # per request.
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_S},
        pool_size=SQLITE_POOL_SIZE,
        max_overflow=SQLITE_POOL_SIZE,
    )
    wal_set = threading.Event()

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy, not the sqlite3 module, decide when transactions begin.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        if not wal_set.is_set():  # WAL is a property of the file: once per process is enough
            cur.execute("PRAGMA journal_mode=WAL")
            wal_set.set()
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        # No checkpoint at commit: it would run (with its fsync) while the committing request
        # holds the write lock, stalling every writer behind it. `Database.checkpoint` runs
        # them from a background task instead, beside the writers.
        cur.execute("PRAGMA wal_autocheckpoint=0")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        immediate = conn.get_execution_options().get("cpool_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


APPLICATION_NAME = "computepool"  # the pool's sessions, as pg_stat_activity names them (usage.open_since)


class Database:
    """One engine per process; short sessions per request. Lives on `app.state.db`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.dialect = make_url(url).get_backend_name()
        if self.dialect == "sqlite":
            self.engine = _sqlite_engine(url)
        else:
            self.engine = create_engine(
                url,
                pool_pre_ping=True,
                pool_recycle=1800,
                pool_size=PG_POOL_SIZE,
                max_overflow=PG_POOL_SIZE,
                connect_args={"connect_timeout": PG_CONNECT_TIMEOUT_S, "application_name": APPLICATION_NAME},
            )
        self._writers = threading.Lock() if self.dialect == "sqlite" else None
        # write transactions begun / as of the last complete checkpoint (-1: none yet, so the
        # first one runs whatever migrations or an earlier process left in the log)
        self._writes = 0
        self._checkpointed = -1
        self._read = sessionmaker(self.engine, expire_on_commit=False)
        self._write = sessionmaker(self.engine.execution_options(cpool_write=True), expire_on_commit=False)
        self.audit_key: bytes | None = None

    def set_audit_key(self, key: bytes) -> None:
        """Sessions opened from now on seal the audit head with `key` (see `store.audit`)."""
        self.audit_key = key
        for maker in (self._read, self._write):
            maker.configure(info={AUDIT_KEY_INFO: key})

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A session for queries; rolled back at the end."""
        with self._read() as session:
            try:
                yield session
            finally:
                session.rollback()

    @contextmanager
    def write(self) -> Iterator[Session]:
        """A transaction committed when the block ends, rolled back if it raises."""
        with self._writers or nullcontext(), self._write() as session, session.begin():
            self._writes += 1  # under the writers' lock on SQLite (checkpoint reads it)
            yield session

    def checkpoint(self) -> None:
        """Copy the SQLite write-ahead log back into the database file (PASSIVE: never waits
        for, nor blocks, readers or writers). A no-op on PostgreSQL, and once a checkpoint copied
        the whole log, until this process writes again: other processes' connections checkpoint
        their own commits (SQLite's default), only this process's do not (`wal_autocheckpoint=0`)."""
        if self.dialect != "sqlite":
            return
        writes = self._writes
        if writes == self._checkpointed:
            return
        with self.engine.connect() as conn:
            row = conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)").first()
        if row is not None and row[0] == 0 and row[1] == row[2]:  # not busy, every frame copied
            self._checkpointed = writes

    def ping(self) -> None:
        """Raise if the database cannot answer a trivial query."""
        with self.engine.connect() as conn:
            conn.execute(select(1))

    def dispose(self) -> None:
        self.engine.dispose()


def db_now(session: Session) -> datetime:
    """The database's clock, so that every replica measures ages (heartbeats, expiry) alike.

    SQLite is a file on this host: its clock is this process's clock, read without a query.
    """
    if session.get_bind().dialect.name == "sqlite":
        return datetime.now(UTC)
    value = session.execute(text("SELECT clock_timestamp()")).scalar_one()
    return value.astimezone(UTC)
