"""Jobs' output in the database, as the agents ship it.

A log is one (allocation, rank, stream): the agent writes it per attempt (`stream_offset`), readers
see each attempt's output after the previous one's (`pos`), stdout and stderr never mixed; offsets
are in UTF-8 bytes.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from computepool.store.models import AllocationLog


def stream_length(session: Session, alloc_id: int, attempt: int, stream: str, rank: int = 0) -> int:
    """Bytes of one attempt's stream of one gang member: where the agent's next chunk starts."""
    stmt = select(func.max(AllocationLog.stream_offset + AllocationLog.size)).where(
        AllocationLog.allocation_id == alloc_id,
        AllocationLog.rank == rank,
        AllocationLog.stream == stream,
        AllocationLog.attempt == attempt,
    )
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
) -> None:
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


def read_log(
    session: Session, alloc_id: int, rank: int, stream: str, offset: int, max_bytes: int
) -> tuple[str, int]:
    """About `max_bytes` of one member's stream from byte `offset` (whole characters); (data, next)."""
    stmt = (
        select(AllocationLog.pos, AllocationLog.data)
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
    for pos, data in session.execute(stmt):
        raw = data.encode()[max(0, offset - pos) :]
        room = max_bytes - len(out)
        if len(raw) > room:
            raw = raw[:room].decode(errors="ignore").encode()  # cut on a character boundary
        out += raw
        nxt = max(pos, offset) + len(raw)
        if len(out) >= max_bytes or not raw:
            break
    return out.decode(errors="replace"), nxt
