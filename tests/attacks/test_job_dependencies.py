"""A tenant uses a job dependency to learn when and how another tenant's work ended."""

from __future__ import annotations

from harness import Api
from test_allocations import A, alloc


def test_after_another_tenants_allocation_reads_as_a_missing_one(api: Api) -> None:
    """Waiting on a victim's job would tell the attacker when and how it ended (ok or failed)."""
    api.tenant("acme")
    mallory = api.user("mallory", "acme", "member")
    theirs = alloc(api, command=["true"])
    r1 = api.post(A, json={"command": ["true"], "after": [{"id": theirs["id"]}]}, headers=mallory)
    r2 = api.post(A, json={"command": ["true"], "after": [{"id": 10**9}]}, headers=mallory)
    assert r1.status_code == r2.status_code == 422
    assert r1.text.replace(str(theirs["id"]), "X") == r2.text.replace(str(10**9), "X")
    assert "after[0]" in r1.text and "not found" in r1.text
    r3 = api.post(A, json={"command": ["true"], "after": [{"id": 1, "x": 1}]}, headers=mallory)
    assert r3.status_code == 422 and "after" in r3.text
