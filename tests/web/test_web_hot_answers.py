"""The submit route serialises its answer itself (no second validation by the framework): a
browser session's submit still gets 201, then 200 for a repeated Idempotency-Key, the same body as
a read of the allocation, and the session's no-store headers; a bearer-token one gets none."""

from __future__ import annotations

import uuid

import httpx
from poolkit import PoolServer

from computepool.server.auth import csrf_token

NO_STORE = {"cache-control": "no-store", "x-content-type-options": "nosniff"}
ASK = {"cpu_milli": 100, "memory_mib": 64, "name": "hot-answer", "command": ["true"]}


def test_a_cookie_submit_keeps_its_status_body_and_headers(server: PoolServer) -> None:
    with httpx.Client(base_url=server.url, timeout=10, follow_redirects=False) as browser:
        assert browser.post("/ui/login", data={"token": server.token}).status_code == 303
        key = {"X-CSRF-Token": csrf_token(server.token), "Idempotency-Key": uuid.uuid4().hex}
        made = browser.post("/api/v1/allocations", json=ASK, headers=key)
        assert made.status_code == 201, made.text
        assert made.headers["content-type"] == "application/json"
        assert all(made.headers.get(k) == v for k, v in NO_STORE.items())
        again = browser.post("/api/v1/allocations", json=ASK, headers=key)
        assert again.status_code == 200 and again.json()["id"] == made.json()["id"]
        assert all(again.headers.get(k) == v for k, v in NO_STORE.items())
    bearer = {"Authorization": f"Bearer {server.token}"}
    read = httpx.get(f"{server.url}/api/v1/allocations/{made.json()['id']}", headers=bearer)
    fields = ("id", "name", "tenant", "owner", "state", "attempt", "request", "command", "created_at")
    assert {k: made.json()[k] for k in fields} == {k: read.json()[k] for k in fields}
    plain = httpx.post(f"{server.url}/api/v1/allocations", json=ASK, headers=bearer)
    assert plain.status_code == 201 and "cache-control" not in plain.headers
