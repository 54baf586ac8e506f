"""Which replica leads: the scheduling lease held, renewed and given up in one place.

One object per server process owns the lease and its term (Nomad's establish/revoke leadership):
the scheduler renews it, every leader-only loop asks it for the term before a pass and fences each
write with `holds` in the same transaction, so a replica that lost the lease meanwhile writes
nothing. No loop reads the lease on its own.

On PostgreSQL the leader also holds a session-level advisory lock on a connection of its own.
A leader that dies (kill -9, a crash, a host that reboots) closes that connection and the lock
goes at once; a standby, which tries the lock a few times a second, then takes the lease over
without waiting for it to expire (a new term fences the old leader out, as always). A leader that
is alive but frozen or cut off keeps its lock (or PostgreSQL notices its dead connection only
after the keepalive probes below): the lease's expiry is the fallback, and a replica that finds
its lease taken while it held the lock gives the lock up, so the lock follows the lease. SQLite
(one host, one replica) keeps the lease alone.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from datetime import datetime

from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from computepool.store import lease
from computepool.store.db import PG_CONNECT_TIMEOUT_S, Database, db_now

log = logging.getLogger("computepool.server")

LEASE_TTL_S = 10.0
STANDBY_CHECK_S = 1.0  # a standby that cannot take the lock reads the lease this often (expiry)
LOCK_SPACE = 0x63706F6C  # "cpol": the advisory-lock namespace; the key within it is the schema's hash
# How soon PostgreSQL gives up on the lock's connection when its peer's host goes silent: probes
# after 5 s idle, every 2 s, 3 of them (the server side; libpq does the same on ours).
KEEPALIVE = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3}
_TRY = text("SELECT pg_try_advisory_lock(:space, hashtext(current_schema()))")
_UNLOCK = text("SELECT pg_advisory_unlock(:space, hashtext(current_schema()))")


class AdvisoryLock:
    """The leader's PostgreSQL advisory lock, on a dedicated autocommit connection (no pool)."""

    def __init__(self, url: str) -> None:
        self._engine: Engine = create_engine(
            url,
            poolclass=NullPool,
            isolation_level="AUTOCOMMIT",
            connect_args={"connect_timeout": PG_CONNECT_TIMEOUT_S, **KEEPALIVE},
        )
        self._conn: Connection | None = None
        self.held = False

    def hold(self) -> bool:
        """Take the lock, or check that it is still ours (the connection alive); never raises."""
        if self.held and self._conn is not None:
            try:
                self._conn.execute(text("SELECT 1"))
                return True
            except SQLAlchemyError:
                self._drop()  # its connection is gone, and the lock with it: try afresh
        try:
            if self._conn is None:
                self._conn = self._engine.connect()
                for name in ("idle", "interval", "count"):
                    self._conn.execute(text(f"SET tcp_keepalives_{name} = {KEEPALIVE[f'keepalives_{name}']}"))
            self.held = bool(self._conn.execute(_TRY, {"space": LOCK_SPACE}).scalar())
        except SQLAlchemyError as e:
            log.debug("leadership: advisory lock unavailable: %s", e)
            self._drop()
        return self.held

    def release(self) -> None:
        if self._conn is not None and self.held:
            try:
                self._conn.execute(_UNLOCK, {"space": LOCK_SPACE})
            except SQLAlchemyError:
                self._drop()  # closing the connection releases it as well
        self.held = False

    def close(self) -> None:
        self.release()
        self._drop()
        self._engine.dispose()

    def _drop(self) -> None:
        self.held = False
        if self._conn is not None:
            conn, self._conn = self._conn, None
            with contextlib.suppress(SQLAlchemyError):
                conn.close()


class Leadership:
    """The lease as this process last saw it; `term` is None while another replica leads.

    `since` is the database's time at which this replica last began to lead with a working
    database: node silence is counted from no earlier than that (a leader that was away, or a
    database that was, has seen nothing of the nodes meanwhile, whatever stored heartbeats say).
    """

    def __init__(self, db: Database, *, ttl_s: float = LEASE_TTL_S, holder: str | None = None) -> None:
        self.db = db
        self.ttl_s = ttl_s
        self.holder = holder or uuid.uuid4().hex[:16]
        self._term: int | None = None  # the term held, as of the last renewal
        self._renewed = 0.0
        self._checked = 0.0  # when a standby last read the lease
        self._lock = AdvisoryLock(db.url) if db.dialect == "postgresql" else None
        self._mutex = threading.Lock()  # one thread at a time on the lock's connection
        self._owed = False  # the lock was won from a holder that is gone: take the lease over
        self.since: datetime | None = None

    @property
    def fast(self) -> bool:
        """Whether a standby should try often: a dead leader's lock is released at once."""
        return self._lock is not None

    def _take_lock(self) -> None:
        """Try the advisory lock (PostgreSQL); won just now, its last holder is gone (`_owed`)."""
        if self._lock is None:
            return
        before = self._lock.held
        held = self._lock.hold()
        self._owed = held and (self._owed or not before)

    def acquire(self) -> int | None:
        """Take or renew the lease in the database; the term, or None while another replica holds it."""
        with self._mutex:
            self._take_lock()
            return self._acquire()

    def _acquire(self) -> int | None:
        was, take_over = self.term, self._owed
        self._checked = time.monotonic()
        try:
            with self.db.write() as s:
                now = db_now(s)
                term = lease.acquire_lease(s, self.holder, now, self.ttl_s, take_over=take_over)
        except Exception:
            self._term = None  # the database failed us: lead again only from a fresh renewal
            raise
        self._owed = False
        if term is None and self._lock is not None and self._lock.held and not take_over:
            log.info("leadership: another replica took the lease; giving up the advisory lock")
            self._lock.release()
        self._term, self._renewed = term, time.monotonic()
        if term is not None and term != was:
            self.since = now
            log.info("leadership: leading in term %d", term)
        return term

    def renewed_term(self) -> int | None:
        """The term, renewing the lease only once a third of its time has passed: a busy pool
        runs many cycles a second, and each renewal is a write. Writes stay fenced by the term in
        the database, so a lease lost meanwhile writes nothing."""
        if self._term is not None and time.monotonic() - self._renewed < self.ttl_s / 3:
            return self._term
        with self._mutex:
            self._take_lock()
            standby = self._lock is not None and not self._lock.held and self.term is None
            if standby and time.monotonic() - self._checked < STANDBY_CHECK_S:
                return None  # the leader lives (it holds the lock): its lease is read once a second
            return self._acquire()

    def lost(self) -> None:
        """A fenced write found the term gone, or the database failed: lead no more until the next
        renewal says so (which counts as leading anew: `since` moves)."""
        self._term = None

    def observed_since(self, at: datetime) -> None:
        """As if this replica had led with a working database since `at` (tests move time back)."""
        self.since = at if self.since is None else min(self.since, at)

    def close(self) -> None:
        """Give the advisory lock up (a standby takes over at once) and close its connection."""
        if self._lock is not None:
            with self._mutex:
                self._lock.close()

    @property
    def leader(self) -> bool:
        """Whether this process held the lease at its last renewal, within its TTL."""
        return self._term is not None and time.monotonic() - self._renewed < self.ttl_s

    @property
    def term(self) -> int | None:
        """The term this process holds (as of its last renewal, within its TTL), else None."""
        return self._term if self.leader else None

    def holds(self, s: Session, term: int) -> bool:
        """In the caller's transaction: the lease is still this process's, at `term` (locks the row)."""
        return lease.holds_lease(s, self.holder, term)
