"""A replica is ready only when its node's agent saw the replica's own process listen on its port:
the real app (SQLite and PostgreSQL), the agents' reports through the real endpoint, and a real
HTTP server on the replica's port standing for whoever listens there (the engine, or a squatter)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from harness import free_port
from test_allocations import cycle, get
from test_allocations_agent import report
from test_service_controller import Pool


class Listener:
    """Answers 200 on every path and keeps the Authorization headers it was shown."""

    def __init__(self, port: int) -> None:
        self.seen: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                owner.seen.append(self.headers.get("Authorization") or "")
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def pool(make_api: Any) -> Iterator[Pool]:
    lo = free_port()
    p = Pool(make_api(service_port_min=lo, service_port_max=lo + 40))
    yield p
    p.close()


def start(pool: Pool, **spec: Any) -> tuple[dict[str, Any], Listener]:
    """One service with one replica, bound to n1 and reported running, something answering on its port."""
    pool.join("n1")
    pool.put("chat", min_replicas=1, max_replicas=1, **spec)
    pool.step()
    [r] = pool.replicas("chat")
    cycle(pool.api)
    a = get(pool.api, r["allocation_id"])
    assert a["state"] == "bound", a
    tell(pool, a, None)
    port = int(a["env"]["PORT"])
    return a, Listener(port)


def tell(pool: Pool, a: dict[str, Any], listener: str | None) -> None:
    body: dict[str, Any] = {"allocation_id": a["id"], "attempt": a["attempt"], "state": "running"}
    if listener is not None:
        body["listener"] = listener
    report(pool.api, "n1", pool.nodes["n1"], body)


def test_healthy_is_not_ready_until_the_replica_itself_listens(pool: Pool) -> None:
    a, ear = start(pool, startup_grace_s=600)
    try:
        for finding in (None, "none", "other"):
            if finding is not None:
                tell(pool, a, finding)
            assert pool.step().ready == []
            [r] = pool.replicas("chat")
            assert r["state"] == "active" and r["replica_state"] == "starting", (finding, r)
        # not one health check reached whoever listens there: it would have shown the replica's key
        assert ear.seen == []
        tell(pool, a, "own")
        assert pool.step().ready == [a["id"]]
        assert len(ear.seen) == 1 and ear.seen[0].startswith("Bearer ")
    finally:
        ear.close()


def test_held_by_another_past_the_grace_it_is_replaced_on_another_port(pool: Pool) -> None:
    a, ear = start(pool, startup_grace_s=1)
    port = int(a["env"]["PORT"])
    try:
        tell(pool, a, "other")
        assert pool.step().ended == []  # within its grace: it may still come
        time.sleep(1.2)
        assert pool.step().ended == [a["id"]]
        gone = get(pool.api, a["id"])
        assert gone["state"] == "cancelled", gone
        assert gone["reason"] == f"port {port} on node n1 is held by another process"
        assert ear.seen == []
        pool.step()
        [new] = pool.replicas("chat")
        assert new["allocation_id"] != a["id"]
        assert int(get(pool.api, new["allocation_id"])["env"]["PORT"]) != port
        assert f"port {port} on node n1 is held by another process" in pool.show("chat")["reason"]
    finally:
        ear.close()


def test_a_ready_replica_whose_port_changes_hands_is_replaced_at_once(pool: Pool) -> None:
    a, ear = start(pool, startup_grace_s=600)
    port = int(a["env"]["PORT"])
    try:
        tell(pool, a, "own")
        assert pool.step().ready == [a["id"]]
        tell(pool, a, "other")
        assert pool.step().ended == [a["id"]]
        assert get(pool.api, a["id"])["reason"] == f"port {port} on node n1 is held by another process"
    finally:
        ear.close()


def test_a_new_attempt_forgets_what_the_last_one_found(pool: Pool) -> None:
    """A requeued replica starts over: the "own" its earlier attempt had does not make it ready."""
    a, ear = start(pool, startup_grace_s=600)
    try:
        tell(pool, a, "own")
        assert pool.step().ready == [a["id"]]
        lost = {"allocation_id": a["id"], "attempt": a["attempt"], "state": "lost", "reason": "gone"}
        report(pool.api, "n1", pool.nodes["n1"], lost)
        pool.step()
        cycle(pool.api)
        again = get(pool.api, a["id"])
        assert again["state"] == "bound" and again["attempt"] == a["attempt"] + 1, again
        tell(pool, again, None)
        assert pool.step().ready == []
        tell(pool, again, "own")
        assert pool.step().ready == [a["id"]]
    finally:
        ear.close()
