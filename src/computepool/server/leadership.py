"""Which replica leads: the scheduling lease held, renewed and given up in one place.

One object per server process owns the lease and its term (Nomad's establish/revoke leadership):
the scheduler renews it, every leader-only loop asks it for the term before a pass and fences each
write with `holds` in the same transaction, so a replica that lost the lease meanwhile writes
nothing. No loop reads the lease on its own.
"""

from __future__ import annotations

import time
import uuid

from sqlalchemy.orm import Session

from computepool.store import lease
from computepool.store.db import Database, db_now

LEASE_TTL_S = 10.0


class Leadership:
    """The lease as this process last saw it; `term` is None while another replica leads."""

    def __init__(self, db: Database, *, ttl_s: float = LEASE_TTL_S, holder: str | None = None) -> None:
        self.db = db
        self.ttl_s = ttl_s
        self.holder = holder or uuid.uuid4().hex[:16]
        self._term: int | None = None  # the term held, as of the last renewal
        self._renewed = 0.0

    def acquire(self) -> int | None:
        """Take or renew the lease in the database; the term, or None while another replica holds it."""
        with self.db.write() as s:
            term = lease.acquire_lease(s, self.holder, db_now(s), self.ttl_s)
        self._term, self._renewed = term, time.monotonic()
        return term

    def renewed_term(self) -> int | None:
        """The term, renewing the lease only once a third of its time has passed: a busy pool
        runs many cycles a second, and each renewal is a write. Writes stay fenced by the term in
        the database, so a lease lost meanwhile writes nothing."""
        if self._term is not None and time.monotonic() - self._renewed < self.ttl_s / 3:
            return self._term
        return self.acquire()

    def lost(self) -> None:
        """A fenced write found the term gone: lead no more until the next renewal says so."""
        self._term = None

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
