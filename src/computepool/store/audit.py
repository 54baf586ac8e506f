"""The append-only audit log, hash-chained so that an edited, removed or reordered row is found.

Each record's hash is the SHA-256 of its canonical JSON, which includes the previous record's
hash. `audit_head` holds the last sequence number and hash; appending locks that row
(`SELECT … FOR UPDATE` on PostgreSQL; SQLite write transactions are already exclusive), so
concurrent writers — threads or server replicas — extend one chain instead of forking it.

A chain alone cannot show records cut from its end, or a tail rewritten along with the head: the
result is again a valid chain. So the head is also sealed — `mac`, an HMAC-SHA256 of (seq, hash)
under the server's audit key, which the database does not hold — and the server keeps an anchor
of the last head it saw outside the database (see `server.logic.audit`). The key reaches
`append_many` through the session's `info` (`Database.set_audit_key`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from computepool.store.models import AuditHead, AuditRecord

GENESIS_HASH = "0" * 64


@dataclass(frozen=True)
class AuditEvent:
    """What happened, before it gets a place in the chain."""

    actor: str
    action: str
    target: str
    outcome: str
    request_id: str
    tenant: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ChainReport:
    ok: bool
    records: int
    first_broken: int | None
    cause: str | None = None


@dataclass(frozen=True)
class Anchor:
    """A head this server saw sealed: the table must still reach `seq`, with this hash there."""

    seq: int
    hash: str


AUDIT_KEY_INFO = "cpool_audit_key"  # Session.info key under which the server's audit key travels


def seal(key: bytes, seq: int, head_hash: str) -> str:
    """The head's signature: only a holder of the key can move the head and keep it valid."""
    return hmac.new(key, f"audit-head:{seq}:{head_hash}".encode(), hashlib.sha256).hexdigest()


def seal_matches(key: bytes, seq: int, head_hash: str, mac: str | None) -> bool:
    if mac is None:
        return seq == 0 and head_hash == GENESIS_HASH  # an empty chain needs no seal
    return hmac.compare_digest(seal(key, seq, head_hash), mac)


def _iso(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


_HASHED = (
    "seq",
    "time",
    "actor",
    "tenant",
    "action",
    "target",
    "outcome",
    "request_id",
    "detail",
    "prev_hash",
)


def _canonical(row: dict[str, Any]) -> bytes:
    doc = {k: row[k] for k in _HASHED}
    doc["time"] = _iso(row["time"])
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def canonical_json(rec: AuditRecord) -> bytes:
    """The bytes that are hashed: sorted keys, no spaces, UTC time to the microsecond."""
    return _canonical({k: getattr(rec, k) for k in _HASHED})


def record_hash(rec: AuditRecord) -> str:
    return hashlib.sha256(canonical_json(rec)).hexdigest()


_HEAD_T = AuditHead.__table__
_HEAD = select(_HEAD_T.c.seq, _HEAD_T.c.hash).where(_HEAD_T.c.id == 1).with_for_update()
_INSERT = AuditRecord.__table__.insert()
_MOVE_HEAD = (
    _HEAD_T.update()
    .where(_HEAD_T.c.id == 1)
    .values(seq=bindparam("new_seq"), hash=bindparam("new_hash"), mac=bindparam("new_mac"))
)


def append_many(session: Session, events: Sequence[AuditEvent], now: datetime) -> None:
    """Add records at the end of the chain in one statement (a scheduling cycle's decisions):
    the same chain as one `append` each, at a fraction of the cost."""
    if not events:
        return
    conn = session.connection()
    seq, prev = conn.execute(_HEAD).one()
    at = now.astimezone(UTC)
    rows: list[dict[str, Any]] = []
    for ev in events:
        seq += 1
        row = {
            "seq": seq,
            "time": at,
            "actor": ev.actor,
            "tenant": ev.tenant,
            "action": ev.action,
            "target": ev.target[:256],
            "outcome": ev.outcome[:64],
            "request_id": ev.request_id[:64],
            "detail": dict(ev.detail),
            "prev_hash": prev,
        }
        row["hash"] = prev = hashlib.sha256(_canonical(row)).hexdigest()
        rows.append(row)
    for i in range(0, len(rows), 1000):
        conn.execute(_INSERT, rows[i : i + 1000])
    key = session.info.get(AUDIT_KEY_INFO)
    mac = seal(key, seq, prev) if key else None
    conn.execute(_MOVE_HEAD, {"new_seq": seq, "new_hash": prev, "new_mac": mac})


def read_head(session: Session) -> tuple[int, str, str | None]:
    """(seq, hash, mac) of the head row."""
    row = session.execute(select(_HEAD_T.c.seq, _HEAD_T.c.hash, _HEAD_T.c.mac).where(_HEAD_T.c.id == 1)).one()
    return int(row.seq), str(row.hash), row.mac


def reseal(session: Session, key: bytes) -> int:
    """Seal the head as it is now (first start with a key); returns its seq."""
    seq, head_hash, _ = read_head(session)
    session.execute(_HEAD_T.update().where(_HEAD_T.c.id == 1).values(mac=seal(key, seq, head_hash)))
    return seq


def hash_at(session: Session, seq: int) -> str | None:
    """The stored hash of record `seq`, or None when there is no such record."""
    return session.execute(select(AuditRecord.hash).where(AuditRecord.seq == seq)).scalar_one_or_none()


def append(session: Session, event: AuditEvent, now: datetime) -> None:
    """Add one record at the end of the chain, inside the caller's transaction."""
    append_many(session, [event], now)


def query(
    session: Session,
    *,
    tenant: str | None = None,
    actor: str | None = None,
    action: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    after_seq: int = 0,
    limit: int = 1000,
) -> Sequence[AuditRecord]:
    """Records in chain order, filtered; `after_seq` pages on."""
    stmt = select(AuditRecord).where(AuditRecord.seq > after_seq)
    if tenant is not None:
        stmt = stmt.where(AuditRecord.tenant == tenant)
    if actor is not None:
        stmt = stmt.where(AuditRecord.actor == actor)
    if action is not None:
        stmt = stmt.where(AuditRecord.action == action)
    if since is not None:
        stmt = stmt.where(AuditRecord.time >= since)
    if until is not None:
        stmt = stmt.where(AuditRecord.time < until)
    return session.scalars(stmt.order_by(AuditRecord.seq).limit(limit)).all()


def verify(session: Session, key: bytes | None = None, anchor: Anchor | None = None) -> ChainReport:
    """Recompute every hash and link, then hold the end of the chain against the head, its seal
    (with `key`) and the server's anchor; `first_broken` is the first sequence number that fails."""
    # The head first, and the records up to it: on PostgreSQL each statement sees the latest
    # commits, and a record appended meanwhile (with its head, in one transaction) would make a
    # head read after the records look past the table's end ("records cut") when nothing was cut.
    seq, head_hash, mac = read_head(session)
    prev, expected, count = GENESIS_HASH, 1, 0
    at_anchor: str | None = None
    stmt = select(AuditRecord).where(AuditRecord.seq <= seq).order_by(AuditRecord.seq)
    for rec in session.scalars(stmt.execution_options(yield_per=1000)):
        if rec.seq != expected or rec.prev_hash != prev or record_hash(rec) != rec.hash:
            why = f"broken at record {expected}: edited, removed or reordered (hash or link does not match)"
            return ChainReport(ok=False, records=count, first_broken=expected, cause=why)
        if anchor is not None and rec.seq == anchor.seq:
            at_anchor = rec.hash
        prev, expected, count = rec.hash, expected + 1, count + 1
    # Records past the head: appended since it was read (the head moved with them), or put there
    # without it. Read the table's end, then the head again: a head older than the end is not
    # a race (each append commits its record and its head together).
    last = int(session.scalar(select(func.max(AuditRecord.seq))) or 0)
    if last > seq:
        seq_now = read_head(session)[0]
        if last > seq_now:
            seq, count, prev = seq_now, last, ""  # reported as a head that does not match the end
    cause: str | None = None
    first = count + 1
    if seq > count:
        cause = f"records cut from the end: head says seq {seq}, table ends at {count}"
    elif seq != count or head_hash != prev:
        cause = f"head does not match the last record: head says seq {seq}, table ends at {count}"
        first = count
    elif key is not None and not seal_matches(key, seq, head_hash, mac):
        cause = "head signature does not match: the head was changed without the server's audit key"
        first = count
    elif anchor is not None and anchor.seq > count:
        cause = f"records cut from the end: the server's anchor says seq {anchor.seq}, table ends at {count}"
    elif anchor is not None and anchor.seq > 0 and at_anchor != anchor.hash:
        cause = f"tail rewritten: record {anchor.seq} differs from the one the server anchored"
        first = anchor.seq
    if cause is not None:
        return ChainReport(ok=False, records=count, first_broken=max(first, 1), cause=cause)
    return ChainReport(ok=True, records=count, first_broken=None)
