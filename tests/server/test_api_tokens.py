"""API token expiry and revocation; join tokens: single use, expiry, reuse, wrong secrets; node state."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from harness import Api, heartbeat_ago


def test_token_secret_is_shown_once_and_never_listed(api: Api) -> None:
    api.tenant("a")
    api.ok("POST", "/api/v1/users", json={"name": "bob", "tenant": "a", "role": "member"})
    created = api.ok("POST", "/api/v1/tokens", json={"user": "bob", "name": "laptop"})
    token_id, secret = created["token"].split(".")
    assert created["id"] == token_id and len(secret) >= 43
    listed = api.get("/api/v1/tokens", headers=api.admin)
    assert secret not in listed.text
    row = next(t for t in listed.json()["items"] if t["id"] == token_id)
    assert row["user"] == "bob" and row["name"] == "laptop" and "token" not in row
    assert secret not in api.get("/api/v1/audit", headers=api.admin).text


def test_token_expiry_and_revocation(api: Api) -> None:
    api.tenant("a")
    api.ok("POST", "/api/v1/users", json={"name": "bob", "tenant": "a", "role": "member"})
    short = api.ok("POST", "/api/v1/tokens", json={"user": "bob", "expires_in_s": 1})
    assert short["expires_at"] is not None
    long = api.ok("POST", "/api/v1/tokens", json={"user": "bob"})
    h_short = {"Authorization": f"Bearer {short['token']}"}
    h_long = {"Authorization": f"Bearer {long['token']}"}
    assert api.get("/api/v1/whoami", headers=h_short).json()["name"] == "bob"
    # a wrong secret for a real id is refused like any other bad token
    forged = {"Authorization": f"Bearer {short['id']}." + "x" * 43}
    assert api.get("/api/v1/whoami", headers=forged).status_code == 401
    time.sleep(1.2)
    r = api.get("/api/v1/whoami", headers=h_short)
    assert r.status_code == 401 and "expired" in r.json()["error"]
    assert api.get("/api/v1/whoami", headers=h_long).status_code == 200
    revoked = api.ok("DELETE", f"/api/v1/tokens/{long['id']}", headers=h_long)
    assert revoked["revoked_at"] is not None
    r = api.get("/api/v1/whoami", headers=h_long)
    assert r.status_code == 401 and "revoked" in r.json()["error"]
    assert api.delete("/api/v1/tokens/0000000000000000", headers=api.admin).status_code == 404


def _join_body(token: str, name: str) -> dict[str, Any]:
    return {"join_token": token, "name": name, "cpu_milli": 8000, "memory_mib": 1024, "devices": []}


def test_join_tokens_single_use_expiry_and_wrong_secrets(api: Api) -> None:
    once = api.ok("POST", "/api/v1/join-tokens", json={"expires_in_s": 600, "single_use": True})["token"]
    many = api.ok("POST", "/api/v1/join-tokens", json={"expires_in_s": 600, "single_use": False})["token"]
    brief = api.ok("POST", "/api/v1/join-tokens", json={"expires_in_s": 1})["token"]

    assert api.post("/api/v1/nodes/join", json=_join_body(once, "n1")).status_code == 201
    r = api.post("/api/v1/nodes/join", json=_join_body(once, "n2"))
    assert r.status_code == 401 and "used already" in r.json()["error"]
    assert api.post("/api/v1/nodes/join", json=_join_body(many, "n2")).status_code == 201
    assert api.post("/api/v1/nodes/join", json=_join_body(many, "n3")).status_code == 201
    # a name that is taken does not use up a single-use token
    fresh = api.ok("POST", "/api/v1/join-tokens", json={})["token"]
    assert api.post("/api/v1/nodes/join", json=_join_body(fresh, "n1")).status_code == 409
    assert api.post("/api/v1/nodes/join", json=_join_body(fresh, "n4")).status_code == 201

    token_id = once.split(".")[0]
    for bad in (f"{token_id}." + "A" * 43, "not-a-token", "", api.admin["Authorization"].split()[1]):
        r = api.post("/api/v1/nodes/join", json=_join_body(bad, "n9"))
        assert r.status_code == 401, (bad, r.text)
        assert "join_token" in r.json()["error"]
    # an API token is no join token, and a join token is no API token
    assert api.get("/api/v1/whoami", headers={"Authorization": f"Bearer {many}"}).status_code == 401

    time.sleep(1.2)
    r = api.post("/api/v1/nodes/join", json=_join_body(brief, "n5"))
    assert r.status_code == 401 and "expired" in r.json()["error"]
    names = {n["name"] for n in api.ok("GET", "/api/v1/nodes")["items"]}
    assert names == {"n1", "n2", "n3", "n4"}


def test_node_state_follows_heartbeat_age(make_api: Callable[..., Api]) -> None:
    api = make_api(heartbeat_interval_s=0.1, suspect_after_s=50, lost_after_s=100)
    node = api.join_node("n1", devices=2)
    other = api.join_node("n2", devices=0)

    def state() -> str:
        return str(api.ok("GET", "/api/v1/nodes")["items"][0]["state"])

    assert state() == "ready"
    heartbeat_ago(api, "n1", 60)
    assert state() == "suspect"
    heartbeat_ago(api, "n1", 120)
    assert state() == "lost"
    usage = {"devices_usage": [{"index": 1, "used_memory_mib": 512, "utilization_pct": 37.5}]}
    hb = api.ok("POST", "/api/v1/nodes/n1/heartbeat", headers=node, json=usage)
    assert hb["heartbeat_interval_s"] == 0.1
    listed = api.ok("GET", "/api/v1/nodes")["items"][0]
    assert listed["state"] == "ready"
    assert listed["devices"][1]["used_memory_mib"] == 512
    # a node's credential is bound to its node; unknown devices are named
    assert api.post("/api/v1/nodes/n1/heartbeat", headers=other, json={}).status_code == 403
    r = api.post("/api/v1/nodes/n1/heartbeat", headers=node, json={"devices_usage": [{"index": 7}]})
    assert r.status_code == 422 and r.json()["field"] == "devices_usage[0].index"


def test_cordon_drain_and_delete(api: Api) -> None:
    cred = api.join_node("n1")
    assert api.ok("POST", "/api/v1/nodes/n1/cordon")["cordoned"] is True
    drained = api.ok("POST", "/api/v1/nodes/n1/drain")
    assert drained["cordoned"] and drained["draining"]
    assert api.ok("POST", "/api/v1/nodes/n1/heartbeat", headers=cred, json={})["draining"] is True
    back = api.ok("POST", "/api/v1/nodes/n1/uncordon")
    assert not back["cordoned"] and not back["draining"]
    assert api.post("/api/v1/nodes/nosuch/cordon", headers=api.admin).status_code == 404
    api.ok("DELETE", "/api/v1/nodes/n1")
    assert api.post("/api/v1/nodes/n1/heartbeat", headers=cred, json={}).status_code == 401
    assert api.ok("GET", "/api/v1/nodes")["items"] == []
