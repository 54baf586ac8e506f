"""Each replica's own key (CPOOL_SERVICE_KEY), on the real app (SQLite and PostgreSQL): given to the
replica by its env and to nobody else through the API, shown by the controller's health checks and
by the gateway with every forwarded request (never the caller's own token), refused when a user
tries to set it, and dropped once the replica ends. The engines are real HTTP servers on loopback:
one in this process that records what it is sent, and simengine.py run as a process."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from gateway_kit import ENGINE_PYTHON, SIMENGINE, wait_until
from harness import free_port
from sqlalchemy import select
from test_service_controller import Pool, S

from computepool.store.models import Allocation

KEY = "CPOOL_SERVICE_KEY"


class KeyedEngine:
    """An engine that wants `Bearer KEY` on every path and records each Authorization it was sent."""

    def __init__(self, port: int, key: str) -> None:
        self.seen: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                given = self.headers.get("Authorization", "")
                owner.seen.append(given)
                ok = given == f"Bearer {key}"
                usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
                body = json.dumps({"choices": [{"text": "yes"}], "usage": usage} if ok else {"error": "key"})
                self.send_response(200 if ok else 401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            do_GET = do_POST = answer  # noqa: N815 (the stdlib's names)

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


def stored_env(pool: Pool, alloc_id: int) -> tuple[dict[str, str], dict[str, Any]]:
    """The allocation's env and request as stored (what the API must not show)."""
    with pool.api.app.state.db.read() as s:
        stmt = select(Allocation.env, Allocation.request).where(Allocation.id == alloc_id)
        env, req = s.execute(stmt).one()
    return dict(env or {}), dict(req)


def test_a_replica_answers_only_its_key_which_the_api_never_shows(pool: Pool) -> None:
    api = pool.api
    node = pool.join("n1")
    api.tenant("t1")
    alice = api.user("alice", "t1", "member")
    spec = {"request": {"command": ["engine"], "cpu_milli": 1000}, "min_replicas": 2, "max_replicas": 2}
    r = api.put(f"{S}/chat", json={"spec": spec}, headers=alice)
    assert r.status_code == 201, r.text

    def reps() -> list[dict[str, Any]]:
        return list(api.ok("GET", f"{S}/chat", headers=alice)["replicas"])

    assert len(pool.step().started) == 2
    ids = [x["allocation_id"] for x in reps()]
    keys = {i: stored_env(pool, i)[0][KEY] for i in ids}
    assert len(set(keys.values())) == 2 and all(len(k) >= 43 for k in keys.values())  # one each, 32 bytes
    for i in ids:
        assert KEY not in stored_env(pool, i)[1].get("env", {})  # the env alone holds it, not the request

    # the node's agent is given it; the API shows it to nobody, admins included
    pool.run(ids[0], healthy=False)
    got = api.ok("GET", "/api/v1/nodes/n1/assignments", headers=node)["assignments"]
    given = {a["allocation_id"]: a["env"][KEY] for a in got if KEY in a["env"]}
    assert given[ids[0]] == keys[ids[0]] and all(keys[i] == k for i, k in given.items()), given
    for who in (alice, api.admin):
        one = api.ok("GET", f"/api/v1/allocations/{ids[0]}", headers=who)
        assert one["env"][KEY] == "(hidden)" and KEY not in (one["request"]["env"] or {})
        for path in ("/api/v1/allocations", f"/api/v1/allocations/{ids[0]}", S, f"{S}/chat"):
            text = api.get(path, headers=who).text
            assert not any(k in text for k in keys.values()), path

    # the controller's health check shows the key: an engine wanting it becomes ready
    port = int(api.ok("GET", f"/api/v1/allocations/{ids[0]}")["env"]["PORT"])
    engine = KeyedEngine(port, keys[ids[0]])
    try:
        pool.step()
        states = {x["allocation_id"]: x["replica_state"] for x in reps()}
        assert states[ids[0]] == "ready", states
        assert engine.seen and set(engine.seen) == {f"Bearer {keys[ids[0]]}"}
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 401  # without it: refused

        # the gateway forwards with the replica's key, never the caller's token
        engine.seen.clear()
        r = api.post("/v1/completions", json={"model": "chat", "prompt": "hi"}, headers=alice)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        assert engine.seen == [f"Bearer {keys[ids[0]]}"]
        assert alice["Authorization"] not in engine.seen

        # once the replica ends, its key is gone from the database too
        assert api.delete(f"{S}/chat", headers=alice).status_code == 200

        def released() -> bool:  # drained once the gateways' reports show it idle
            pool.step()
            return bool(api.ok("GET", f"/api/v1/allocations/{ids[0]}")["state"] == "released")

        wait_until(released, timeout=10, what="the drained replica's release")
        for i in ids:
            env, req = stored_env(pool, i)
            assert KEY not in env and KEY not in (req.get("env") or {}) and "PORT" in env
    finally:
        engine.close()


def test_a_user_may_not_set_the_key(pool: Pool) -> None:
    pool.join("n1")
    spec = {"request": {"command": ["engine"], "cpu_milli": 1000, "env": {KEY: "mine"}}}
    r = pool.api.put(f"{S}/chat", json={"spec": spec}, headers=pool.api.admin)
    assert r.status_code == 422 and "spec.request.env" in r.text and KEY in r.text, r.text
    r = pool.api.post(
        "/api/v1/allocations", json={"command": ["x"], "env": {KEY: "m"}}, headers=pool.api.admin
    )
    assert r.status_code == 422 and KEY in r.text, r.text


def test_simengine_wants_the_key_on_v1_but_not_on_health(tmp_path: Any) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [ENGINE_PYTHON, str(SIMENGINE), "--host", "127.0.0.1", "--port", str(port), "--ms-per-token", "0"],
        env={"CPOOL_SERVICE_KEY": "k-123", "PATH": "/usr/bin:/bin"},
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "exited"
            try:
                return httpx.get(f"{base}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, 15, "simengine")
        body = {"model": "sim", "prompt": "a b c", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer k-12"}, {"Authorization": "Basic k-123"}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/nope")):
                r = httpx.request(method, base + path, json=body, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        good = {"Authorization": "Bearer k-123"}
        assert httpx.get(f"{base}/v1/models", headers=good).status_code == 200
        r = httpx.post(f"{base}/v1/completions", json=body, headers=good)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        with httpx.Client(base_url=base) as kept:  # a refused request does not spoil the next one
            assert kept.post("/v1/completions", json=body).status_code == 401
            assert kept.post("/v1/completions", json=body, headers=good).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
