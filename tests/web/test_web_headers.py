"""Answers to the dashboard (its pages, and the API called with its session cookie) are never
cached and never content-sniffed; bearer-token API answers are left as they were."""

from __future__ import annotations

import httpx
from poolkit import PoolServer

from computepool.server.auth import csrf_token

NO_STORE = {"cache-control": "no-store", "x-content-type-options": "nosniff"}


def carries(r: httpx.Response) -> bool:
    return all(r.headers.get(k) == v for k, v in NO_STORE.items())


def test_cookie_answers_are_not_cached_or_sniffed(server: PoolServer) -> None:
    with httpx.Client(base_url=server.url, timeout=10, follow_redirects=False) as browser:
        for path in ("/", "/ui/overview", "/ui/static/nothing.js"):  # signed out: sign-in, redirect, 404
            assert carries(browser.get(path)), path
        assert browser.post("/ui/login", data={"token": server.token}).status_code == 303
        for path in ("/", "/ui/alerts", "/ui/work/99999"):
            assert carries(browser.get(path)), path
        # the API with the cookie: its answers, its refusals and its errors
        ok = browser.get("/api/v1/alerts")
        assert ok.status_code == 200 and carries(ok)
        no_csrf = browser.put("/api/v1/alert-rules/node-lost", json={"enabled": True})
        assert no_csrf.status_code == 403 and carries(no_csrf)
        csrf = {"X-CSRF-Token": csrf_token(server.token)}
        put = browser.put("/api/v1/alert-rules/node-lost", json={"enabled": True}, headers=csrf)
        assert put.status_code == 200 and carries(put)
        missing = browser.get("/api/v1/allocations/99999999999999999999")
        assert missing.status_code == 404 and carries(missing)
    with httpx.Client(base_url=server.url, timeout=10) as bare:
        bare.cookies.set("cpool_session", "nonsense.token")
        refused = bare.get("/api/v1/alerts")
        assert refused.status_code == 401 and carries(refused)
    # a script's bearer-token call: unchanged
    r = httpx.get(f"{server.url}/api/v1/alerts", headers={"Authorization": f"Bearer {server.token}"})
    assert r.status_code == 200 and "cache-control" not in r.headers
