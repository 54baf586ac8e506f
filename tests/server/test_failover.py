"""Failover on PostgreSQL: a leader that dies hands over at once (its advisory lock goes with its
connection), long before its lease would expire; a frozen leader is fenced out by the term and,
once thawed, writes nothing and leaves the lease with its successor."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from harness import PgServer
from sqlalchemy import text
from test_server_process import start_server_process, stop_server_process

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


def _role(base: str) -> str | None:
    try:
        return str(httpx.get(f"{base}/readyz", timeout=2).json().get("scheduler"))
    except (httpx.HTTPError, ValueError):
        return None


def _wait(what: str, ok: Callable[[], bool], within_s: float = 60) -> None:
    deadline = time.monotonic() + within_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_frozen_leader_replica_is_fenced_out_and_stays_standby(
    backend: str, postgres: PgServer, tmp_path: Path
) -> None:
    """Two `cpool server` processes: the leader frozen (SIGSTOP) while work waits, the standby
    takes over once the lease expires, and the thawed one writes nothing afterwards: no audit
    record of the old term follows the new term's first, later work is bound in the new term, and
    the lease stays with the successor."""
    url = postgres.new_database()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    bases: dict[str, str] = {}
    stop = threading.Event()
    try:
        for name in ("a", "b"):
            procs[name], bases[name] = start_server_process(
                tmp_path / name,
                url,
                tmp_path / f"{name}.log",
                "--log-level",
                "warning",
                "--audit-key-file",
                str(tmp_path / "audit-key"),
            )
        admin = {"Authorization": f"Bearer {(tmp_path / 'a' / 'admin-token').read_text().strip()}"}
        _wait("one leader", lambda: sorted(str(_role(b)) for b in bases.values()) == ["leader", "standby"])
        old = next(n for n, b in bases.items() if _role(b) == "leader")
        new = "b" if old == "a" else "a"
        c = httpx.Client(base_url=bases[new], headers=admin, timeout=15)
        jt = c.post("/api/v1/join-tokens", json={"expires_in_s": 600}).json()["token"]
        dev = {"vendor": "nvidia", "model": "A100", "memory_mib": 40960}
        devices = [{**dev, "index": i, "uuid": f"GPU-f{i}"} for i in range(8)]
        body = {"join_token": jt, "name": "f1", "cpu_milli": 8000, "memory_mib": 65536, "devices": devices}
        joined = c.post("/api/v1/nodes/join", json=body)
        assert joined.status_code == 201, joined.text
        node = {"Authorization": f"Bearer {joined.json()['credential']}"}

        def beat() -> None:  # the node reports through the replica that stays up
            while not stop.wait(1.0):
                with contextlib.suppress(httpx.HTTPError):
                    httpx.post(f"{bases[new]}/api/v1/nodes/f1/heartbeat", headers=node, json={}, timeout=5)

        threading.Thread(target=beat, daemon=True).start()

        def bound(i: int) -> bool:
            return bool(c.get(f"/api/v1/allocations/{i}").json()["state"] == "bound")

        first = c.post("/api/v1/allocations", json={"gpus": 1}).json()["id"]
        _wait("a bind by the first leader", lambda: bound(first))
        procs[old].send_signal(signal.SIGSTOP)
        waiting = [c.post("/api/v1/allocations", json={"gpus": 1}).json()["id"] for _ in range(2)]
        _wait("the standby to take over and bind", lambda: all(bound(i) for i in waiting))
        assert _role(bases[new]) == "leader"
        procs[old].send_signal(signal.SIGCONT)
        thawed = httpx.Client(base_url=bases[old], headers=admin, timeout=15)
        later = thawed.post("/api/v1/allocations", json={"gpus": 1}).json()["id"]  # wakes its scheduler
        _wait("the thawed replica to stand by", lambda: _role(bases[old]) == "standby")
        _wait("the later request bound", lambda: bound(later))
        for _ in range(3):  # it stays so: the lock follows the lease
            time.sleep(1.0)
            assert (_role(bases[old]), _role(bases[new])) == ("standby", "leader")
        schema = url.rsplit("%3D", 1)[1]
        with postgres.admin_conn() as conn:
            terms = conn.execute(
                f'SELECT request_id, min(seq), max(seq) FROM "{schema}".audit_records '
                "WHERE actor = 'scheduler' GROUP BY request_id"
            ).fetchall()
            by_term = {int(r[0].split(":")[1]): (int(r[1]), int(r[2])) for r in terms}
            held = conn.execute(
                f"SELECT id, term FROM \"{schema}\".allocations WHERE state = 'bound'"
            ).fetchall()
        assert sorted(by_term) == [1, 2] and by_term[1][1] < by_term[2][0], by_term
        assert {int(i): int(t) for i, t in held} == {first: 1, **{i: 2 for i in (*waiting, later)}}
    finally:
        stop.set()
        for proc in procs.values():
            proc.send_signal(signal.SIGCONT)
            stop_server_process(proc)
