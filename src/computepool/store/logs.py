"""Jobs' output in the database, as the agents ship it.

A log is one (allocation, rank, stream): the agent writes it per attempt (`stream_offset`), readers
see each attempt's output after the previous one's (`pos`), stdout and stderr never mixed; offsets
are in UTF-8 bytes.

Logs are capped: an attempt's stream keeps its last `cap` bytes, a tenant its newest bytes over all
its allocations, and logs of allocations ended long ago go (the server's log pass). What is dropped
from the head of an attempt's stream is stood for by one marker row (`stream_offset` MARKER) that
spans the dropped bytes' places (`pos`, `size`) and holds a line saying how many went: readers page
on as before and see that line where the output was. Rows are dropped whole, oldest first.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, case, delete, func, select, update
from sqlalchemy.orm import Session

from computepool.store.models import Allocation, AllocationLog, Tenant

MARKER = -1  # the stream_offset of a marker row: its stream bytes are [0, size) of its attempt
_DATA = AllocationLog.stream_offset >= 0


def marker_text(dropped: int, stream: str) -> str:
    """The line readers see where an attempt's `stream` lost its first `dropped` bytes."""
    return f"[cpool: {dropped} bytes of this attempt's {stream} dropped here: over the log cap]\n"


@dataclass(frozen=True)
class Key:
    """One attempt's stream of one gang member: the unit a cap trims and a marker stands for."""

    allocation_id: int
    rank: int
    stream: str
    attempt: int

    def where(self) -> list[ColumnElement[bool]]:
        return [
            AllocationLog.allocation_id == self.allocation_id,
            AllocationLog.rank == self.rank,
            AllocationLog.stream == self.stream,
            AllocationLog.attempt == self.attempt,
        ]


def stream_length(session: Session, alloc_id: int, attempt: int, stream: str, rank: int = 0) -> int:
    """Bytes of one attempt's stream of one gang member: where the agent's next chunk starts (the
    dropped bytes count: a marker stands for them)."""
    end = case((_DATA, AllocationLog.stream_offset + AllocationLog.size), else_=AllocationLog.size)
    stmt = select(func.max(end)).where(*Key(alloc_id, rank, stream, attempt).where())
    return int(session.execute(stmt).scalar_one() or 0)


def log_length(session: Session, alloc_id: int, rank: int, stream: str) -> int:
    """Bytes of a member's stream over all attempts: where a reader that has everything stands."""
    stmt = select(func.max(AllocationLog.pos + AllocationLog.size)).where(
        AllocationLog.allocation_id == alloc_id, AllocationLog.rank == rank, AllocationLog.stream == stream
    )
    return int(session.execute(stmt).scalar_one() or 0)


def append_log(
    session: Session,
    alloc_id: int,
    attempt: int,
    stream: str,
    stream_offset: int,
    data: str,
    rank: int = 0,
    cap: int | None = None,
) -> int:
    """Add a chunk; with `cap`, then drop the attempt stream's oldest rows until it holds at most
    `cap` bytes. Returns the bytes dropped."""
    session.add(
        AllocationLog(
            allocation_id=alloc_id,
            attempt=attempt,
            rank=rank,
            stream=stream,
            stream_offset=stream_offset,
            pos=log_length(session, alloc_id, rank, stream),
            size=len(data.encode()),
            data=data,
        )
    )
    session.flush()
    return 0 if cap is None else cap_stream(session, Key(alloc_id, rank, stream, attempt), cap)


def cap_stream(session: Session, key: Key, cap: int) -> int:
    """Drop `key`'s oldest rows until it holds at most `cap` bytes (its marker then says so);
    returns the bytes dropped now."""
    first, end = session.execute(
        select(
            func.min(AllocationLog.stream_offset), func.max(AllocationLog.stream_offset + AllocationLog.size)
        ).where(*key.where(), _DATA)
    ).one()
    if first is None or end - first <= cap:
        return 0
    base = _base(session, key)
    rows = session.execute(
        select(AllocationLog.id, AllocationLog.size).where(
            *key.where(), _DATA, AllocationLog.stream_offset < end - cap
        )
    ).all()
    session.connection().execute(delete(AllocationLog).where(AllocationLog.id.in_([r.id for r in rows])))
    _mark(session, key, base, end)
    return sum(int(r.size) for r in rows)


def _base(session: Session, key: Key) -> int:
    """Where `key`'s attempt begins among the member's log positions (`pos` of its byte 0)."""
    row = session.execute(
        select(AllocationLog.pos, AllocationLog.stream_offset).where(*key.where()).limit(1)
    ).first()
    if row is None:
        return 0
    return int(row.pos) if row.stream_offset < 0 else int(row.pos - row.stream_offset)


def _mark(session: Session, key: Key, base: int, end: int) -> None:
    """Make `key`'s marker stand for what its rows no longer hold: bytes [0, first kept) of the
    attempt (all `end` of them when no row is left)."""
    first = session.execute(select(func.min(AllocationLog.stream_offset)).where(*key.where(), _DATA)).scalar()
    dropped = int(first if first is not None else end)
    if dropped <= 0:
        return
    text = marker_text(dropped, key.stream)
    done = session.connection().execute(
        update(AllocationLog)
        .where(*key.where(), AllocationLog.stream_offset == MARKER)
        .values(size=dropped, data=text)
    )
    if not done.rowcount:
        session.add(
            AllocationLog(
                allocation_id=key.allocation_id, attempt=key.attempt, rank=key.rank, stream=key.stream,
                stream_offset=MARKER, pos=base, size=dropped, data=text,
            )
        )  # fmt: skip
    session.flush()


def read_log(
    session: Session, alloc_id: int, rank: int, stream: str, offset: int, max_bytes: int
) -> tuple[str, int]:
    """About `max_bytes` of one member's stream from byte `offset` (whole characters); (data, next).

    A marker is read whole by a reader short of its span's end, and moves it past that span."""
    stmt = (
        select(AllocationLog.pos, AllocationLog.size, AllocationLog.stream_offset, AllocationLog.data)
        .where(
            AllocationLog.allocation_id == alloc_id,
            AllocationLog.rank == rank,
            AllocationLog.stream == stream,
            AllocationLog.pos + AllocationLog.size > offset,
        )
        .order_by(AllocationLog.pos)
    )
    out = bytearray()
    nxt = offset
    for pos, size, stream_offset, data in session.execute(stmt):
        if stream_offset == MARKER:
            text = data.encode()
            if out and len(text) > max_bytes - len(out):
                break
            out += text
            nxt = pos + size
            continue
        raw = data.encode()[max(0, offset - pos) :]
        room = max_bytes - len(out)
        if len(raw) > room:
            raw = raw[:room].decode(errors="ignore").encode()  # cut on a character boundary
        out += raw
        nxt = max(pos, offset) + len(raw)
        if len(out) >= max_bytes or not raw:
            break
    return out.decode(errors="replace"), nxt


def last_lines(
    session: Session, alloc_id: int, stream: str, lines: int = 3, max_bytes: int = 2048
) -> list[str]:
    """The last non-blank `lines` of rank 0's stream (within its last `max_bytes`): why an engine
    that exited failed, in its own words."""
    end = log_length(session, alloc_id, 0, stream)
    data, _ = read_log(session, alloc_id, 0, stream, max(0, end - max_bytes), max_bytes)
    return [line.strip() for line in data.splitlines() if line.strip()][-lines:]


def tenant_bytes(session: Session) -> dict[str, int]:
    """Log bytes each tenant holds over all its allocations (markers aside), by tenant name."""
    stmt = (
        select(Tenant.name, func.sum(AllocationLog.size))
        .join(Allocation, Allocation.id == AllocationLog.allocation_id)
        .join(Tenant, Tenant.id == Allocation.tenant_id)
        .where(_DATA)
        .group_by(Tenant.name)
    )
    return {name: int(total or 0) for name, total in session.execute(stmt)}


def cap_tenant(session: Session, tenant: str, cap: int, batch: int = 1000) -> int:
    """Drop `tenant`'s oldest rows (any allocation's, oldest written first) until its logs hold at
    most `cap` bytes; each stream that lost some gets its marker. Returns the bytes dropped."""
    excess = tenant_bytes_of(session, tenant) - cap
    dropped = 0
    spans: dict[Key, tuple[int, int]] = {}  # a touched stream → (its base, the end of what went)
    while dropped < excess:
        rows = session.execute(
            select(
                AllocationLog.id, AllocationLog.allocation_id, AllocationLog.rank, AllocationLog.stream,
                AllocationLog.attempt, AllocationLog.pos, AllocationLog.stream_offset, AllocationLog.size,
            )
            .join(Allocation, Allocation.id == AllocationLog.allocation_id)
            .join(Tenant, Tenant.id == Allocation.tenant_id)
            .where(Tenant.name == tenant, _DATA)
            .order_by(AllocationLog.id)
            .limit(batch)
        ).all()  # fmt: skip
        if not rows:
            break
        gone: list[int] = []
        for r in rows:
            if dropped >= excess:
                break
            gone.append(r.id)
            dropped += int(r.size)
            key = Key(r.allocation_id, r.rank, r.stream, r.attempt)
            _, end = spans.get(key, (0, 0))
            spans[key] = (int(r.pos - r.stream_offset), max(end, int(r.stream_offset + r.size)))
        session.connection().execute(delete(AllocationLog).where(AllocationLog.id.in_(gone)))
    for key, (base, end) in spans.items():
        _mark(
            session,
            key,
            base,
            max(end, stream_length(session, key.allocation_id, key.attempt, key.stream, key.rank)),
        )
    return dropped


def tenant_bytes_of(session: Session, tenant: str) -> int:
    stmt = (
        select(func.sum(AllocationLog.size))
        .join(Allocation, Allocation.id == AllocationLog.allocation_id)
        .join(Tenant, Tenant.id == Allocation.tenant_id)
        .where(Tenant.name == tenant, _DATA)
    )
    return int(session.execute(stmt).scalar() or 0)


def drop_ended_before(session: Session, cutoff: datetime, batch: int = 500) -> int:
    """Delete the logs of up to `batch` allocations that ended before `cutoff` and still have some;
    returns how many allocations lost their logs (call again while it is `batch`)."""
    ids = list(
        session.execute(
            select(Allocation.id)
            .where(
                Allocation.ended_at < cutoff,
                select(AllocationLog.id).where(AllocationLog.allocation_id == Allocation.id).exists(),
            )
            .limit(batch)
        ).scalars()
    )
    if ids:
        session.connection().execute(delete(AllocationLog).where(AllocationLog.allocation_id.in_(ids)))
    return len(ids)
