"""Migration 0008 keeps stored output readable: each chunk's place moves from the combined log to
its own (allocation, rank, stream) log, so stdout and stderr page apart from then on."""

from __future__ import annotations

from sqlalchemy import text

from computepool.store import Database, logs, upgrade

ALLOC = """
INSERT INTO allocations (id, name, tenant_id, owner, request, priority, restartable, state, reason,
    attempt, term, nodes, slices, created_at)
VALUES (1, '', 1, 'alice', '{}', 0, false, 'released', 'exited 0', 2, 1, '["n1"]', '[]', :now)
"""
CHUNK = """
INSERT INTO allocation_logs (allocation_id, attempt, stream, stream_offset, pos, size, data)
VALUES (1, :attempt, :stream, :offset, :pos, :size, :data)
"""


def test_0008_places_old_chunks_in_their_own_stream(empty_db_url: str) -> None:
    db = Database(empty_db_url)
    try:
        upgrade(db, "0007")
        # output as the server stored it before: one combined log, arrival order (two attempts)
        chunks = [(1, "stdout", "a1\n"), (1, "stderr", "E1\n"), (1, "stdout", "b1\n"), (2, "stdout", "a2\n")]
        with db.engine.begin() as conn:
            now = conn.execute(text("SELECT CURRENT_TIMESTAMP")).scalar()
            conn.execute(text("INSERT INTO tenants (id, name, weight, created_at) VALUES (1, 't', 1, :now)"),
                         {"now": now})  # fmt: skip
            conn.execute(text(ALLOC), {"now": now})
            pos, offsets = 0, {}
            for attempt, stream, data in chunks:
                off = offsets.get((attempt, stream), 0)
                conn.execute(text(CHUNK), {"attempt": attempt, "stream": stream, "offset": off,
                                           "pos": pos, "size": len(data), "data": data})  # fmt: skip
                offsets[(attempt, stream)] = off + len(data)
                pos += len(data)
        upgrade(db)
        with db.read() as s:
            assert logs.read_log(s, 1, 0, "stdout", 0, 1 << 20) == ("a1\nb1\na2\n", 9)
            assert logs.read_log(s, 1, 0, "stderr", 0, 1 << 20) == ("E1\n", 3)
            assert logs.read_log(s, 1, 0, "stdout", 6, 1 << 20) == ("a2\n", 9)
            assert logs.log_length(s, 1, 0, "stdout") == 9
            assert logs.stream_length(s, 1, 2, "stdout") == 3  # the agent's offsets stay per attempt
    finally:
        db.dispose()
