"""Two `cpool server` processes on one PostgreSQL: both serve the API, one schedules; when that one
is killed, the other takes the lease over (a new term) and scheduling goes on."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
from harness import PgServer
from test_server_process import start_server_process, stop_server_process

LEASE_TTL_S = 10.0  # scheduling.LEASE_TTL_S


def _start(data_dir: Path, db_url: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    return start_server_process(
        data_dir, db_url, log, "--suspect-s", "120", "--lost-s", "240", "--log-level", "warning"
    )


def _lease(pg: PgServer, db_url: str) -> tuple[str, int] | None:
    schema = db_url.rsplit("%3D", 1)[1]
    with pg.admin_conn() as conn:
        row = conn.execute(f'SELECT holder, term FROM "{schema}".scheduler_lease').fetchone()
    return None if row is None else (str(row[0]), int(row[1]))


def _bound(c: httpx.Client, alloc_id: int, within_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    while True:
        a = c.get(f"/api/v1/allocations/{alloc_id}", params={"wait": 2, "state": "pending"}).json()
        if a["state"] != "pending" or time.monotonic() > deadline:
            return dict(a)


def test_the_other_replica_takes_over_scheduling(postgres: PgServer, tmp_path: Path) -> None:
    url = postgres.new_database()
    first, a = _start(tmp_path / "a", url, tmp_path / "a.log")
    second = None
    try:
        second_proc, b = _start(tmp_path / "b", url, tmp_path / "b.log")
        second = second_proc
        token = (tmp_path / "a" / "admin-token").read_text().strip()
        assert not (tmp_path / "b" / "admin-token").exists()  # one admin for the pool, made once
        admin = {"Authorization": f"Bearer {token}"}
        with (
            httpx.Client(base_url=a, headers=admin, timeout=15) as ca,
            httpx.Client(base_url=b, headers=admin, timeout=15) as cb,
        ):
            jt = ca.post("/api/v1/join-tokens", json={"expires_in_s": 600}).json()["token"]
            dev = {"index": 0, "vendor": "nvidia", "model": "A100", "memory_mib": 40960, "uuid": "GPU-r0"}
            body = {
                "join_token": jt,
                "name": "r1",
                "cpu_milli": 8000,
                "memory_mib": 65536,
                "devices": [dev, {**dev, "index": 1, "uuid": "GPU-r1"}],
            }
            assert cb.post("/api/v1/nodes/join", json=body).status_code == 201  # joined through B
            one = ca.post("/api/v1/allocations", json={"gpus": 1}).json()
            assert _bound(cb, one["id"], 15)["state"] == "bound"  # seen through the other replica
            before = _lease(postgres, url)
            assert before is not None
            roles = {c.get("/readyz").json()["scheduler"] for c in (ca, cb)}
            assert roles == {"leader", "standby"}, roles  # exactly one schedules
            leader, standby = (
                (first, cb) if ca.get("/readyz").json()["scheduler"] == "leader" else (second, ca)
            )
            leader.send_signal(signal.SIGKILL)
            leader.wait(timeout=10)
            cb = standby
            two = cb.post("/api/v1/allocations", json={"gpus": 1}).json()
            got = _bound(cb, two["id"], LEASE_TTL_S + 15)
            assert got["state"] == "bound", got
            after = _lease(postgres, url)
            assert after is not None and after[0] != before[0] and after[1] == before[1] + 1
            assert got["term"] == after[1]  # bound by the new holder, in its term
            assert cb.get("/api/v1/audit/verify").json()["ok"] is True
            assert cb.get("/readyz").json()["scheduler"] == "leader"
    finally:
        for p in (first, second):
            if p is not None:
                stop_server_process(p)
