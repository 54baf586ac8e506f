"""Failover on PostgreSQL: a leader that dies hands over at once (its advisory lock goes with its
connection), long before its lease would expire; a frozen leader is fenced out by the term and,
once thawed, writes nothing and leaves the lease (and the lock) with its successor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import text

import computepool
from computepool.server.leadership import Leadership
from computepool.store.db import Database, db_now

pytestmark = pytest.mark.parametrize("backend", ["postgresql"])

# A replica's leadership alone, in a process of its own: it leads when it can and, while it leads,
# writes a row fenced by its term every tick, then says so on stdout.
REPLICA = textwrap.dedent(
    """
    import sys, time
    from sqlalchemy import text
    from computepool.server.leadership import Leadership
    from computepool.store.db import Database
    db = Database(sys.argv[1])
    me = Leadership(db, ttl_s=float(sys.argv[2]), holder="old")
    said = None
    while True:
        term = me.renewed_term()
        if term is not None:
            with db.write() as s:
                if me.holds(s, term):
                    s.execute(text("INSERT INTO probe (holder, term) VALUES ('old', :t)"), {"t": term})
        state = f"leader {term}" if term is not None else "standby"
        if state != said:
            print(state, flush=True)
            said = state
        print("tick", flush=True)
        time.sleep(0.3)
    """
)


@pytest.fixture
def pool_db(db_url: str) -> Iterator[Database]:
    db = Database(db_url)
    with db.write() as s:
        s.execute(
            text("CREATE TABLE probe (holder text, term int, at timestamptz DEFAULT clock_timestamp())")
        )
    yield db
    db.dispose()


def _replica(db_url: str, ttl_s: float) -> subprocess.Popen[str]:
    src = str(Path(computepool.__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(
        [sys.executable, "-c", REPLICA, db_url, str(ttl_s)], stdout=subprocess.PIPE, text=True, env=env
    )


def _read_until(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        assert line, f"the replica exited ({proc.poll()}) before saying {prefix!r}"
        if line.startswith(prefix):
            return line.strip()


def _lease(db: Database) -> tuple[str, int, datetime, datetime]:
    with db.read() as s:
        holder, term, expires = s.execute(text("SELECT holder, term, expires_at FROM scheduler_lease")).one()
        return str(holder), int(term), expires, db_now(s)


def _lead(me: Leadership, within_s: float) -> int:
    deadline = time.monotonic() + within_s
    while (term := me.acquire()) is None:
        assert time.monotonic() < deadline, "the standby never took the lease over"
        time.sleep(0.1)
    return term


def test_a_killed_leader_hands_over_before_its_lease_expires(db_url: str, pool_db: Database) -> None:
    old = _replica(db_url, ttl_s=600)  # a lease that outlives the test: only the lock can hand over
    me = Leadership(pool_db, ttl_s=600, holder="new")
    try:
        assert _read_until(old, "leader") == "leader 1"
        assert me.acquire() is None  # it lives: no takeover
        old.send_signal(signal.SIGKILL)
        old.wait(timeout=30)
        assert _lead(me, within_s=60) == 2
        holder, term, expires, now = _lease(pool_db)
        assert (holder, term) == ("new", 2) and expires > now
    finally:
        old.kill()
        me.close()


def test_a_frozen_leader_writes_nothing_after_its_successor_starts(db_url: str, pool_db: Database) -> None:
    old = _replica(db_url, ttl_s=1.0)
    me = Leadership(pool_db, ttl_s=1.0, holder="new")
    try:
        assert _read_until(old, "leader") == "leader 1"
        _read_until(old, "tick")  # between two ticks: not inside a transaction
        old.send_signal(signal.SIGSTOP)
        term = _lead(me, within_s=60)  # the lease expires; the frozen one still holds its lock
        assert term == 2
        with pool_db.read() as s:
            took_over = db_now(s)
        old.send_signal(signal.SIGCONT)
        assert _read_until(old, "standby") == "standby"  # it learned, and wrote nothing meanwhile
        for _ in range(5):
            _read_until(old, "tick")
            assert me.acquire() == 2  # the lease stays with the successor, in its term
        with pool_db.read() as s:
            late = s.execute(
                text("SELECT count(*) FROM probe WHERE holder = 'old' AND at >= :t"), {"t": took_over}
            ).scalar()
            written = s.execute(text("SELECT count(*) FROM probe WHERE holder = 'old'")).scalar()
        assert written and late == 0
        assert _lease(pool_db)[:2] == ("new", 2)
        old.send_signal(signal.SIGKILL)  # its lock given up already, or now: either way the same
        old.wait(timeout=30)
        assert me.acquire() == 2
    finally:
        old.send_signal(signal.SIGCONT)
        old.kill()
        me.close()
