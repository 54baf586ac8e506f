"""LAN discovery's API on the real app (SQLite and PostgreSQL): the discovery key for nodes only, a
node's report of its peers (its own only), and the merged list humans read."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from conftest import Api

from computepool.discovery.announce import derive_key, fingerprint
from computepool.server.keyfile import load_or_create_key

H = dict[str, str]
CPU = {"index": 0, "kind": "cpu", "model": "cpu", "memory_mib": 4096}


def peer(key: str, **kw: Any) -> dict[str, Any]:
    """One PeerReport as an agent sends it."""
    body: dict[str, Any] = {
        "peer_key": key,
        "node_id": key,
        "instance": "0123456789abcdef",
        "address": "10.0.0.2",
        "port": 5757,
        "devices": [{"index": 0, "kind": "cpu", "model": "cpu", "memory_mib": 4096}],
        "status": "ok",
        "reason": "",
        "source": "mdns",
        "rtt_ms": 0.4,
        "bandwidth_mbps": 900.0,
        "last_seen": datetime.now(UTC).isoformat(),
    }
    body.update(kw)
    return body


@pytest.fixture
def lan(api: Api) -> dict[str, H]:
    api.tenant("a")
    return {
        "n1": api.join_node("n1", devices=0),
        "n2": api.join_node("n2", devices=0),
        "viewer": api.user("va", "a", "viewer"),
        "member": api.user("ma", "a", "member"),
    }


def test_the_key_is_derived_from_the_secret_and_only_nodes_get_it(api: Api, lan: dict[str, H]) -> None:
    got = api.ok("GET", "/api/v1/discovery/key", lan["n1"])
    secret = load_or_create_key(api.settings.discovery_key_path, "discovery")
    key = derive_key(secret)
    assert bytes.fromhex(got["key"]) == key != secret
    assert got["fingerprint"] == fingerprint(key)
    assert api.ok("GET", "/api/v1/discovery/key", lan["n2"]) == got  # one key for the pool
    assert (api.settings.discovery_key_path.stat().st_mode & 0o077) == 0
    for who in (api.admin, lan["viewer"], lan["member"]):
        r = api.get("/api/v1/discovery/key", headers=who)
        assert r.status_code == 403, r.text
        assert got["key"] not in r.text


def test_a_node_reports_and_humans_list_merged_by_observer(api: Api, lan: dict[str, H]) -> None:
    rejected = peer(
        "10.0.0.9:5757",
        node_id="n9",
        status="rejected",
        reason="bad signature: not signed with this pool's discovery key",
        devices=[],
        rtt_ms=None,
        bandwidth_mbps=None,
        source="unicast",
    )
    out = api.ok("PUT", "/api/v1/nodes/n1/peers", lan["n1"], json={"peers": [peer("n2"), rejected]})
    assert [(p["observer"], p["peer_key"], p["status"]) for p in out["items"]] == [
        ("n1", "10.0.0.9:5757", "rejected"),
        ("n1", "n2", "ok"),
    ]
    api.ok("PUT", "/api/v1/nodes/n2/peers", lan["n2"], json={"peers": [peer("n1", address="10.0.0.1")]})

    items = api.ok("GET", "/api/v1/peers", lan["viewer"])["items"]
    assert [(p["observer"], p["peer_key"]) for p in items] == [
        ("n1", "10.0.0.9:5757"),
        ("n2", "n1"),
        ("n1", "n2"),
    ]
    bad = items[0]
    assert bad["status"] == "rejected" and bad["reason"].startswith("bad signature")
    assert bad["rtt_ms"] is None and bad["source"] == "unicast"
    good = items[2]
    assert good["devices"] == [{"index": 0, "kind": "cpu", "model": "cpu", "memory_mib": 4096}]
    assert good["rtt_ms"] == 0.4 and good["bandwidth_mbps"] == 900.0 and good["reason"] == ""
    reported_at, last_seen = (datetime.fromisoformat(good[k]) for k in ("reported_at", "last_seen"))
    assert reported_at >= last_seen - timedelta(seconds=5)
    only = api.ok("GET", "/api/v1/peers", params={"observer": "n2"})["items"]
    assert [(p["observer"], p["peer_key"]) for p in only] == [("n2", "n1")]

    # a report replaces the node's earlier one: a peer no longer seen goes
    api.ok("PUT", "/api/v1/nodes/n1/peers", lan["n1"], json={"peers": [peer("n2", rtt_ms=1.5)]})
    items = api.ok("GET", "/api/v1/peers", params={"observer": "n1"})["items"]
    assert [(p["peer_key"], p["rtt_ms"]) for p in items] == [("n2", 1.5)]
    api.ok("PUT", "/api/v1/nodes/n1/peers", lan["n1"], json={"peers": []})
    assert api.ok("GET", "/api/v1/peers", params={"observer": "n1"})["items"] == []

    # a removed node's view is not listed any more
    api.ok("DELETE", "/api/v1/nodes/n2")
    assert api.ok("GET", "/api/v1/peers")["items"] == []


def test_a_node_reports_only_for_itself(api: Api, lan: dict[str, H]) -> None:
    for name in ("n2", "nope"):
        r = api.put(f"/api/v1/nodes/{name}/peers", headers=lan["n1"], json={"peers": [peer("n1")]})
        assert r.status_code == 404, r.text
        assert r.json()["error"] == f"node '{name}' not found"
    assert api.ok("GET", "/api/v1/peers")["items"] == []
    for who, status in ((api.admin, 403), (lan["member"], 403), (lan["viewer"], 403), ({}, 401)):
        r = api.put("/api/v1/nodes/n1/peers", headers=who, json={"peers": []})
        assert r.status_code == status, r.text
    r = api.get("/api/v1/peers", headers=lan["n1"])
    assert r.status_code == 403, r.text


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"peers": [peer("n2", status="maybe")]}, "status"),
        ({"peers": [peer("n2", source="carrier-pigeon")]}, "source"),
        ({"peers": [peer("n2", port=70000)]}, "port"),
        ({"peers": [peer("n2", rtt_ms=-1)]}, "rtt_ms"),
        ({"peers": [peer("n2", last_seen="yesterday")]}, "last_seen"),
        ({"peers": [peer("n2", colour="blue")]}, "colour"),
        ({"peers": [peer("")]}, "peer_key"),
        ({"peers": [peer("n2", devices=[{**CPU, "kind": "tpu"}])]}, "kind"),
        ({"peers": [peer("n2"), peer("n2")]}, "peers[1].peer_key"),
        ({"peers": [peer(f"p{i}") for i in range(257)]}, "peers"),
        ({"nodes": []}, "nodes"),
    ],
)
def test_bad_reports_answer_422_naming_the_field(
    api: Api, lan: dict[str, H], body: dict[str, Any], field: str
) -> None:
    r = api.put("/api/v1/nodes/n1/peers", headers=lan["n1"], json=body)
    assert r.status_code == 422, r.text
    assert field in r.text
    assert api.ok("GET", "/api/v1/peers")["items"] == []


def test_bad_observer_filter_answers_422(api: Api, lan: dict[str, H]) -> None:
    r = api.get("/api/v1/peers", headers=api.admin, params={"observer": "x" * 64})
    assert r.status_code == 422 and "observer" in r.text, r.text


def test_a_skewed_node_clock_neither_ages_nor_freshens_a_peer(api: Api, lan: dict[str, H]) -> None:
    """last_seen is the node's clock: moved to the control plane's by the report's `sent_at` (a
    query parameter: older servers ignore it), and never later than the report's arrival."""
    behind = datetime.now(UTC) - timedelta(minutes=10)  # the node's clock, ten minutes slow
    body = {"peers": [peer("n2", last_seen=(behind - timedelta(seconds=5)).isoformat())]}
    sent = {"sent_at": behind.isoformat()}
    [got] = api.ok("PUT", "/api/v1/nodes/n1/peers", lan["n1"], json=body, params=sent)["items"]
    seen, reported = datetime.fromisoformat(got["last_seen"]), datetime.fromisoformat(got["reported_at"])
    assert reported - timedelta(seconds=60) < seen <= reported - timedelta(seconds=5)  # 5 s before it sent
    ahead = datetime.now(UTC) + timedelta(hours=1)  # no sent_at (an older agent): only clamped
    body = {"peers": [peer("n1", last_seen=ahead.isoformat())]}
    [got] = api.ok("PUT", "/api/v1/nodes/n2/peers", lan["n2"], json=body)["items"]
    assert got["last_seen"] == got["reported_at"]
