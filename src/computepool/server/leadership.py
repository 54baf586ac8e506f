"""Which replica leads: the scheduling lease held, renewed and given up in one place.

One object per server process owns the lease and its term (Nomad's establish/revoke leadership):
the scheduler renews it, every leader-only loop asks it for the term before a pass and fences each
write with `holds` in the same transaction, so a replica that lost the lease meanwhile writes
nothing. No loop reads the lease on its own.

On PostgreSQL every replica also holds a session-level advisory lock of its own (keyed by its
holder name) on a connection of its own. A leader that dies (kill -9, a crash, a host that
reboots) closes that connection and its lock goes at once; a standby, which tries the lease
holder's lock a few times a second, then takes the lease over without waiting for it to expire
(a new term fences the old leader out, as always). A leader that is alive but frozen or cut off
keeps its lock (PostgreSQL notices a dead peer only after the keepalive probes below): there the
lease's expiry is the fallback, and once thawed it finds the term gone and stands by. SQLite
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
STANDBY_CHECK_S = 1.0  # a standby whose leader lives reads the lease this often (its expiry)
LOCK_SPACE = 0x63706F6C  # "cpol": the advisory-lock namespace; a key is the hash of schema:holder
# How soon PostgreSQL gives up on the lock's connection when its peer's host goes silent: probes
# after 5 s idle, every 2 s, 3 of them (the server side; libpq does the same on ours).
KEEPALIVE = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3}
_KEY = "hashtext(current_schema() || ':' || {})"
_OWN = text(f"SELECT pg_try_advisory_lock(:space, {_KEY.format(':me')})")
# The lease's holder, if another replica, and whether its lock could be taken (then it is gone).
_PROBE = text(
    f"SELECT holder, pg_try_advisory_lock(:space, {_KEY.format('holder')}) FROM scheduler_lease "
    "WHERE id = 1 AND holder <> :me"
)
_UNLOCK = text(f"SELECT pg_advisory_unlock(:space, {_KEY.format(':who')})")


class Liveness:
    """Each replica's own PostgreSQL advisory lock, held for its life on a dedicated autocommit
    connection (no pool): another replica that can take it knows the holder's session is gone."""

    def __init__(self, url: str, holder: str) -> None:
        self._engine: Engine = create_engine(
            url,
            poolclass=NullPool,
            isolation_level="AUTOCOMMIT",
            connect_args={"connect_timeout": PG_CONNECT_TIMEOUT_S, **KEEPALIVE},
        )
        self.holder = holder
        self._conn: Connection | None = None
        self.held = False

    def _connection(self) -> Connection:
        if self._conn is None:
            self._conn = self._engine.connect()
            for name in ("idle", "interval", "count"):
                self._conn.execute(text(f"SET tcp_keepalives_{name} = {KEEPALIVE[f'keepalives_{name}']}"))
        return self._conn

    def gone_leader(self) -> str | None:
        """Hold this replica's own lock, and name the lease's holder if its session is gone (its
        lock free); None when this replica holds the lease, another live one does, or on error."""
        try:
            conn = self._connection()
            if not self.held:
                self.held = bool(conn.execute(_OWN, {"space": LOCK_SPACE, "me": self.holder}).scalar())
            row = conn.execute(_PROBE, {"space": LOCK_SPACE, "me": self.holder}).one_or_none()
            if row is None or not row[1]:
                return None
            conn.execute(_UNLOCK, {"space": LOCK_SPACE, "who": row[0]})
            return str(row[0])
        except SQLAlchemyError as e:
            log.debug("leadership: liveness lock unavailable: %s", e)
            self._drop()  # its connection is gone, and the lock with it: taken afresh next time
            return None

    def close(self) -> None:
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
    It is written in the lease row too (`observed_since`), so every replica's `cpool nodes` and
    /metrics judge a node as the leader does.
    """

    def __init__(self, db: Database, *, ttl_s: float = LEASE_TTL_S, holder: str | None = None) -> None:
        self.db = db
        self.ttl_s = ttl_s
        self.holder = holder or uuid.uuid4().hex[:16]
        self._term: int | None = None  # the term held, as of the last renewal
        self._renewed = 0.0
        self._checked = 0.0  # when a standby last read the lease
        self._live = Liveness(db.url, self.holder) if db.dialect == "postgresql" else None
        self._mutex = threading.Lock()  # one thread at a time on the liveness connection
        self.since: datetime | None = None

    @property
    def fast(self) -> bool:
        """Whether a standby should look often: a dead leader is seen at once (PostgreSQL)."""
        return self._live is not None

    def acquire(self) -> int | None:
        """Take or renew the lease in the database; the term, or None while another replica holds it."""
        with self._mutex:
            gone = self._live.gone_leader() if self._live is not None else None
            return self._acquire(gone)

    def _acquire(self, gone: str | None) -> int | None:
        was = self.term
        self._checked = time.monotonic()
        try:
            with self.db.write() as s:
                now = db_now(s)
                term = lease.acquire_lease(s, self.holder, now, self.ttl_s, take_over_from=gone)
                if term is not None and term != was:  # watching afresh: every replica reads it
                    lease.mark_observing(s, self.holder, now)
        except Exception:
            self._term = None  # the database failed us: lead again only from a fresh renewal
            raise
        self._term, self._renewed = term, time.monotonic()
        if term is not None and term != was:
            self.since = now
            log.info("leadership: leading in term %d%s", term, f" (replica {gone} is gone)" if gone else "")
        return term

    def renewed_term(self) -> int | None:
        """The term, renewing the lease only once a third of its time has passed: a busy pool
        runs many cycles a second, and each renewal is a write. Writes stay fenced by the term in
        the database, so a lease lost meanwhile writes nothing. A standby on PostgreSQL asks at
        every call whether the leader's session is gone, and reads the lease once a second."""
        if self._term is not None and time.monotonic() - self._renewed < self.ttl_s / 3:
            return self._term
        with self._mutex:
            gone = self._live.gone_leader() if self._live is not None else None
            standby = gone is None and self._live is not None and self.term is None
            if standby and time.monotonic() - self._checked < STANDBY_CHECK_S:
                return None  # the leader lives: its lease is read once a second (its expiry)
            return self._acquire(gone)

    def lost(self) -> None:
        """A fenced write found the term gone, or the database failed: lead no more until the next
        renewal says so (which counts as leading anew: `since` moves)."""
        self._term = None

    def observed_since(self, at: datetime) -> None:
        """As if this replica had led with a working database since `at` (tests move time back),
        in the lease too when it holds it."""
        self.since = at if self.since is None else min(self.since, at)
        with self.db.write() as s:
            lease.mark_observing(s, self.holder, self.since)

    def close(self) -> None:
        """Give this replica's liveness lock up (a standby takes over at once) and close it."""
        if self._live is not None:
            with self._mutex:
                self._live.close()

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
