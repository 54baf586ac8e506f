"""Helpers of the dashboard tests: users and tokens made through the API."""

from __future__ import annotations

import httpx


def make_user(http: httpx.Client, name: str, tenant: str, role: str) -> str:
    """A user of `tenant` (created when missing) with `role`; returns a fresh token of theirs."""
    r = http.post("/api/v1/tenants", json={"name": tenant})
    assert r.status_code in (201, 409), r.text
    r = http.post("/api/v1/users", json={"name": name, "tenant": tenant, "role": role})
    assert r.status_code == 201, r.text
    r = http.post("/api/v1/tokens", json={"user": name})
    assert r.status_code == 201, r.text
    return str(r.json()["token"])
