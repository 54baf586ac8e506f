"""What `cpool bench failover` measures: kill -9 the scheduling leader K times and time kill → next bind.

Everything is started here and thrown away afterwards: a PostgreSQL cluster (initdb, loopback, a
kernel-picked port), two `cpool server` replicas on it, one simulated node that joins and
heartbeats through whichever replica answers, and a light load (an allocation every half second,
released once bound). Each round kills the leader with SIGKILL, submits an allocation through the
survivor at once and waits for it to be bound; the killed replica is then started again as the
standby. The figure is what a user sees: from the kill to the answer that says "bound".
"""

from __future__ import annotations

import contextlib
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from computepool.chaos.cluster import free_port
from computepool.chaos.postgres import PostgresUnavailable, TempPostgres

READY_TIMEOUT_S = 60.0
BIND_TIMEOUT_S = 120.0
TIMING = ["--heartbeat-s", "1", "--suspect-s", "5", "--lost-s", "20"]  # the simulated node beats each second
DEVICES = 64


class _Replica:
    """One `cpool server` process; started again on a fresh port after each kill."""

    def __init__(self, data_dir: Path, db_url: str, audit_key: Path) -> None:
        self.data_dir, self.db_url, self.audit_key = data_dir, db_url, audit_key
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "computepool.cli.main", "server", "--data-dir", str(self.data_dir)]
        argv += ["--port", str(port), "--db", self.db_url, "--audit-key-file", str(self.audit_key)]
        argv += ["--secrets-key-file", str(self.audit_key.with_name("secrets-key"))]  # shared, as audit-key
        argv += [*TIMING, "--log-level", "warning"]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with (self.data_dir / "server.log").open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while self.role() is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.data_dir / "server.log").read_text(errors="replace")[-600:]
                raise ValueError(f"cpool server did not become ready: {tail}")
            time.sleep(0.1)

    def role(self) -> str | None:
        """leader, standby, or None while it does not answer."""
        try:
            r = httpx.get(f"{self.url}/readyz", timeout=2)
        except httpx.HTTPError:
            return None
        return str(r.json().get("scheduler")) if r.status_code == 200 else None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


class _Pool:
    """Talks to whichever replica answers: the simulated node and the load use it from threads."""

    def __init__(self, replicas: list[_Replica], token: str) -> None:
        self.replicas, self.token = replicas, token
        self.stop = threading.Event()

    def call(self, method: str, path: str, token: str | None = None, **kw: Any) -> httpx.Response | None:
        for r in self.replicas:
            if not r.url:
                continue
            try:
                got = httpx.request(
                    method,
                    r.url + path,
                    headers={"Authorization": f"Bearer {token or self.token}"},
                    timeout=5,
                    **kw,
                )
            except httpx.HTTPError:
                continue
            if got.status_code < 500:
                return got
        return None

    def join(self) -> tuple[str, str]:
        jt = self.call("POST", "/api/v1/join-tokens", json={"expires_in_s": 600})
        if jt is None or jt.status_code != 201:
            raise ValueError("could not make a join token")
        dev = {"vendor": "nvidia", "model": "A100", "memory_mib": 40960}
        body = {
            "join_token": jt.json()["token"],
            "name": "bench-node",
            "cpu_milli": 256_000,
            "memory_mib": 1 << 20,
            "devices": [{**dev, "index": i, "uuid": f"GPU-bench-{i}"} for i in range(DEVICES)],
        }
        got = self.call("POST", "/api/v1/nodes/join", json=body)
        if got is None or got.status_code != 201:
            raise ValueError(
                f"the simulated node could not join: {got.text if got else 'no replica answers'}"
            )
        return "bench-node", str(got.json()["credential"])

    def loop(self, every_s: float, step: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            while not self.stop.wait(every_s):
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    step()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def bound_after(self, alloc_id: int) -> bool:
        """Wait (long-polling) until `alloc_id` leaves pending; whether it got bound in time."""
        deadline = time.monotonic() + BIND_TIMEOUT_S
        while time.monotonic() < deadline:
            got = self.call("GET", f"/api/v1/allocations/{alloc_id}", params={"wait": 2, "state": "pending"})
            if got is not None and got.status_code == 200 and got.json()["state"] != "pending":
                return bool(got.json()["state"] in ("bound", "active"))
        return False


def _roles(replicas: list[_Replica]) -> tuple[_Replica, _Replica]:
    """(leader, standby) once exactly one leads and the other stands by."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        roles = [r.role() for r in replicas]
        if sorted(map(str, roles)) == ["leader", "standby"]:
            lead = roles.index("leader")
            return replicas[lead], replicas[1 - lead]
        time.sleep(0.2)
    raise ValueError("the replicas did not settle on one leader and one standby")


def run_failover(kills: int, say: Callable[[str], None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cpool-bench-failover-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)  # PostgreSQL's account reaches its cluster below
        pg = TempPostgres(root / "pg")
        replicas: list[_Replica] = []
        pool: _Pool | None = None
        try:
            pg.init()
            pg.start()
            url = pg.url
            replicas = [_Replica(root / n, url, root / "audit-key") for n in ("a", "b")]
            for r in replicas:
                r.start()
            pool = _Pool(replicas, (root / "a" / "admin-token").read_text().strip())
            node, cred = pool.join()
            held: list[int] = []

            def beat() -> None:  # the simulated node's heartbeat, through whichever replica answers
                pool.call("POST", f"/api/v1/nodes/{node}/heartbeat", cred, json={})

            def load() -> None:  # an allocation every half second; the one before released
                got = pool.call("POST", "/api/v1/allocations", json={"gpus": 1})
                if got is not None and got.status_code == 201:
                    held.append(int(got.json()["id"]))
                while len(held) > 2:
                    pool.call("POST", f"/api/v1/allocations/{held.pop(0)}/release")

            pool.loop(1.0, beat)
            pool.loop(0.5, load)
            samples: list[float] = []
            for k in range(kills):
                leader, standby = _roles(replicas)
                time.sleep(1.0)  # a steady state: heartbeats and load through both replicas
                t0 = time.monotonic()
                leader.kill()
                got = None
                while got is None or got.status_code != 201:
                    got = pool.call("POST", "/api/v1/allocations", json={"gpus": 1})
                    if time.monotonic() - t0 > BIND_TIMEOUT_S:
                        raise ValueError("the surviving replica took no allocation")
                probe = int(got.json()["id"])
                if not pool.bound_after(probe):
                    raise ValueError(f"kill {k + 1}: nothing was bound within {BIND_TIMEOUT_S:.0f} s")
                samples.append(time.monotonic() - t0)
                say(f"kill {k + 1}/{kills}: next bind after {samples[-1]:.2f} s")
                pool.call("POST", f"/api/v1/allocations/{probe}/release")
                leader.start()  # back as the standby
            return {
                "failover_s": {"p50": round(statistics.median(samples), 3), "max": round(max(samples), 3)},
                "kills": kills,
                "samples": [round(s, 3) for s in samples],
            }
        finally:
            if pool is not None:
                pool.stop.set()
            for r in replicas:
                r.kill()
            with contextlib.suppress(PostgresUnavailable, subprocess.TimeoutExpired):
                pg.stop("immediate")
