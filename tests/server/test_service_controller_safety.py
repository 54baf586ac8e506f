"""The service controller where one tenant's trouble could reach others (SQLite and PostgreSQL):
slow or broken health endpoints, IPv6 and address-less nodes, a rollout changed half-way, ports
whose engine may still be stopping, the per-tenant replica cap, and its own memory of services
that are gone. Real HTTP servers on loopback; the app's controller driven pass by pass."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

import pytest
from harness import free_port
from sqlalchemy import update
from test_allocations import get
from test_service_controller import Pool, S

from computepool.server.logic import replica_health
from computepool.server.logic import service_controller as sc
from computepool.server.logic.replica_health import HEALTH_TIMEOUT_S
from computepool.store import services as store
from computepool.store.db import db_now
from computepool.store.models import Allocation, Node

T = TypeVar("T")


class Engine:
    """A real HTTP server on a replica's port whose health answer can be slow: `delay_s` before
    the headers, then `body` bytes one every `dribble_s`."""

    def __init__(
        self, port: int, host: str = "127.0.0.1", delay_s: float = 0.0, body: int = 0, dribble_s: float = 0.0
    ) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                time.sleep(delay_s)
                self.send_response(200)
                self.send_header("Content-Length", str(body))
                self.end_headers()
                try:
                    for _ in range(body):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(dribble_s)
                except OSError:
                    pass  # the controller gave up on it

            def log_message(self, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            request_queue_size = 512
            daemon_threads = True

        self.server = Server((host, port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def finishes(fn: Callable[[], T], what: str, deadline_s: float = 120) -> T:
    """fn() run in a thread; fails when it is still running at a deadline far past any bound the code
    sets itself (the engines here never answer whole, so an unbounded wait never ends)."""
    box: list[T] = []
    worker = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    worker.start()
    worker.join(deadline_s)
    assert not worker.is_alive(), f"{what} did not finish within {deadline_s} s"
    assert box, f"{what} raised (see the thread's traceback above)"
    return box[0]


class SafetyPool(Pool):
    """The test pool, with engines of this file's kind that it closes at the end."""

    def __init__(self, api: Any) -> None:
        super().__init__(api)
        self.engines: list[Engine] = []

    def engine(self, port: int, **kw: Any) -> Engine:
        e = Engine(port, **kw)
        self.engines.append(e)
        return e

    def close(self) -> None:
        for e in self.engines:
            e.close()
        super().close()


@pytest.fixture
def pool(make_api: Any) -> Iterator[SafetyPool]:
    lo = free_port()
    p = SafetyPool(make_api(service_port_min=lo, service_port_max=lo + 40, max_replicas_per_tenant=4))
    yield p
    p.close()


def _port(pool: Pool, alloc_id: int) -> int:
    return int(get(pool.api, alloc_id)["env"]["PORT"])


def test_a_slow_health_answer_holds_back_no_other_service(pool: SafetyPool) -> None:
    pool.join("n1")
    pool.put("slow", min_replicas=1)
    pool.put("fast", min_replicas=1)
    pool.step()
    [slow] = pool.replicas("slow")
    [fast] = pool.replicas("fast")
    for r in (slow, fast):
        pool.run(r["allocation_id"], healthy=False)
    # headers at once, then a byte every 0.1 s for hours: each read is quick, the answer never ends.
    # A check bounded only per read would hold the pass (and the fast service) until the deadline.
    pool.engine(_port(pool, slow["allocation_id"]), body=100_000, dribble_s=0.1)
    pool.engine(_port(pool, fast["allocation_id"]))
    rep = finishes(pool.step, "a pass with a never-ending health answer")
    assert rep.ready == [fast["allocation_id"]]
    assert pool.replicas("slow")[0]["replica_state"] == "starting"


def test_slow_and_broken_checks_neither_exhaust_connections_nor_stop_the_pass() -> None:
    """More slow engines than an HTTP client's default connection pool, an address no URL can
    hold: the one healthy replica is still found healthy, and each failure is a failed check."""
    slow_port, fast_port = free_port(), free_port()
    engines = [Engine(slow_port, delay_s=3600), Engine(fast_port)]
    try:
        targets: list[tuple[int, str, str | None]] = [
            (i, f"http://127.0.0.1:{slow_port}/health", "k") for i in range(1, 121)
        ]
        targets.append((200, "http://bad host name:31000/health", "k"))  # a URL httpx refuses outright
        targets.append((300, f"http://127.0.0.1:{fast_port}/health", None))
        probes = finishes(lambda: asyncio.run(replica_health.check_all(targets)), "checks of hung engines")
    finally:
        for e in engines:
            e.close()
    assert probes[300].ok, probes[300]
    assert not probes[200].ok and probes[200].detail
    assert not probes[1].ok and f"within {HEALTH_TIMEOUT_S:g} s" in probes[1].detail, probes[1]


def _join(pool: Pool, name: str, address: str) -> None:
    token = pool.api.ok("POST", "/api/v1/join-tokens", json={})["token"]
    body = {"join_token": token, "name": name, "cpu_milli": 4000, "memory_mib": 8192, "address": address}
    cred = pool.api.ok("POST", "/api/v1/nodes/join", json=body, headers={})["credential"]
    pool.nodes[name] = {"Authorization": f"Bearer {cred}"}


def test_an_ipv6_node_is_reached_in_brackets_and_one_without_address_is_not_checked(pool: SafetyPool) -> None:
    assert store.endpoint_of("fd00::1", 31000) == "http://[fd00::1]:31000"
    assert store.endpoint_of("10.0.0.5", 31000) == "http://10.0.0.5:31000"
    assert store.endpoint_of("", 31000) is None and store.endpoint_of(None, 31000) is None
    _join(pool, "v6", "::1")
    pool.put("chat", min_replicas=1)
    pool.step()
    [r] = pool.replicas("chat")
    pool.run(r["allocation_id"], healthy=False)
    port = _port(pool, r["allocation_id"])
    pool.engine(port, host="::1")
    assert pool.step().ready == [r["allocation_id"]]
    [r] = pool.replicas("chat")
    assert r["endpoint"] == f"http://[::1]:{port}" and r["replica_state"] == "ready"
    # a node whose address is unknown: no endpoint, no check (its name is never looked up)
    with pool.api.app.state.db.write() as s:
        s.execute(update(Node).where(Node.name == "v6").values(address=""))
    pool.put("other", min_replicas=1)
    pool.step()
    [o] = pool.replicas("other")
    pool.run(o["allocation_id"], healthy=False)
    pool.engine(_port(pool, o["allocation_id"]))  # it would answer on 127.0.0.1 …
    rep = pool.step()
    assert rep.ready == [] and pool.replicas("other")[0]["endpoint"] is None  # … but is not asked


def test_a_scaling_change_mid_rollout_keeps_the_old_replicas_old(pool: Pool) -> None:
    pool.join("n1")
    pool.put("chat", min_replicas=2, max_replicas=3)
    pool.step()
    old = {r["allocation_id"] for r in pool.ready("chat", 2)}
    changed = {"command": ["engine", "--v2"], "cpu_milli": 1000}
    r = pool.api.put(f"{S}/chat", json={"spec": {"request": changed, "min_replicas": 2, "max_replicas": 3}},
                     headers=pool.api.admin)  # fmt: skip
    assert r.status_code == 200 and r.json()["generation"] == 2
    [new] = pool.step().started  # the rollout's first new replica
    # a scaling change now: the new replica is stamped 3, the old ones stay 1 and are still replaced
    r = pool.api.put(f"{S}/chat", json={"spec": {"request": changed, "min_replicas": 2, "max_replicas": 4}},
                     headers=pool.api.admin)  # fmt: skip
    assert r.status_code == 200 and r.json()["generation"] == 3
    gens = {x["allocation_id"]: x["generation"] for x in pool.replicas("chat")}
    assert gens == {**dict.fromkeys(old, 1), new: 3}, gens
    pool.run(new)
    pool.step()
    assert any(x["replica_state"] == "draining" for x in pool.replicas("chat") if x["allocation_id"] in old)


def test_a_port_just_freed_is_not_given_again_at_once(pool: Pool) -> None:
    pool.join("n1")
    lo = pool.api.settings.service_port_min
    pool.put("chat", min_replicas=1)
    [first] = pool.step().started
    assert _port(pool, first) == lo
    pool.api.ok("DELETE", f"{S}/chat")  # pending: cancelled at once, its row ended
    pool.put("chat", min_replicas=1)
    [second] = pool.step().started
    assert _port(pool, second) == lo + 1  # not lo, though its replica's row has ended
    # five minutes later, lo may be given again (taken in turn: after the others)
    with pool.api.app.state.db.write() as s:
        s.execute(
            update(Allocation)
            .where(Allocation.id == first)
            .values(ended_at=db_now(s) - timedelta(seconds=sc.PORT_COOLDOWN_S + 1))
        )
    with pool.api.app.state.db.read() as s:
        used = store.used_ports(s, db_now(s), sc.PORT_COOLDOWN_S)
    assert lo not in used and lo + 1 in used


def test_ports_run_out_only_when_live_and_recent_ones_hold_them_all(make_api: Any) -> None:
    lo = free_port()
    pool = Pool(make_api(service_port_min=lo, service_port_max=lo + 1))
    try:
        pool.join("n1")
        pool.put("a", min_replicas=1)
        pool.put("b", min_replicas=1)
        assert len(pool.step().started) == 2
        pool.api.ok("DELETE", f"{S}/a")
        pool.put("c", min_replicas=1)
        assert pool.step().started == []
        assert "every service port" in pool.show("c")["reason"]
    finally:
        pool.close()


def _try_put(pool: Pool, name: str, low: int, high: int) -> Any:
    spec = {"request": {"command": ["e"]}, "min_replicas": low, "max_replicas": high}
    return pool.api.put(f"{S}/{name}", json={"spec": spec}, headers=pool.api.admin)


def test_a_tenant_has_at_most_max_replicas_per_tenant(pool: Pool) -> None:
    pool.join("n1")
    r = _try_put(pool, "big", 5, 8)
    assert r.status_code == 422 and r.json()["field"] == "spec.min_replicas", r.text
    assert "max_replicas_per_tenant" in r.json()["error"]
    pool.put("a", min_replicas=3, max_replicas=3)
    pool.put("a", expect=200, min_replicas=3, max_replicas=4)  # its own minimum is not counted twice
    r = _try_put(pool, "b", 2, 4)
    assert r.status_code == 422, r.text
    svc = pool.put("b", min_replicas=0, max_replicas=4)
    assert len(pool.step().started) == 3
    pool.load(svc["id"], queued=12)  # b would want 3, the tenant has room for 1
    assert len(pool.step().started) == 1
    assert pool.step().started == []
    assert "max_replicas_per_tenant" in pool.show("b")["reason"]


def test_the_server_refuses_a_bad_replica_cap(tmp_path: Any) -> None:
    argv = [sys.executable, "-m", "computepool.cli.main", "server", "--data-dir", str(tmp_path)]
    out = subprocess.run(
        [*argv, "--max-replicas-per-tenant", "0"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0 and "max_replicas_per_tenant" in out.stderr + out.stdout, out
    assert "Traceback" not in out.stderr


def test_the_controller_forgets_services_that_are_gone(pool: Pool) -> None:
    pool.join("n1")
    svc = pool.put("chat", min_replicas=1, startup_grace_s=1, drain_s=0)
    pool.step()
    [r] = pool.replicas("chat")
    pool.run(r["allocation_id"], healthy=False)
    time.sleep(1.05)
    assert pool.step().ended == [r["allocation_id"]]  # never healthy: replaced, and remembered
    assert svc["id"] in pool.ctrl._failures and svc["id"] in pool.ctrl._event
    pool.api.ok("DELETE", f"{S}/chat")
    pool.step()
    pool.step()
    assert svc["id"] not in pool.ctrl._failures and svc["id"] not in pool.ctrl._event
    assert svc["id"] not in pool.ctrl._below
