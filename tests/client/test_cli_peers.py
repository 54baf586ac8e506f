"""`cpool peers` against a real `cpool server`: rows two nodes reported through the API, merged by
peer (one item, seen by both, with each link's figures), a rejected sender with its reason, the
`--observer` filter, and the table."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from poolkit import Cli, PoolServer, one_error_line

from computepool.client import PoolClient
from computepool.client.errors import PoolError

CPU = {"index": 0, "kind": "cpu", "model": "cpu", "memory_mib": 8192}
GPU = {"index": 0, "kind": "gpu", "model": "T4", "memory_mib": 16384}


def report(peer_key: str, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "peer_key": peer_key,
        "node_id": peer_key,
        "instance": "a1b2c3d4e5f60718",
        "address": "10.9.0.3",
        "port": 5757,
        "devices": [GPU, CPU],
        "status": "ok",
        "source": "mdns",
        "rtt_ms": 0.25,
        "bandwidth_mbps": 940.0,
        "last_seen": datetime.now(UTC).isoformat(),
    }
    return body | kw


@pytest.fixture(scope="module")
def reported(server: PoolServer) -> PoolServer:
    """Nodes lan-a, lan-b and lan-c joined; lan-a and lan-b each saw lan-c (different links), lan-b
    saw lan-a, and lan-a rejected a forger at 10.9.0.66."""
    creds = {}
    with PoolClient(server.url, token=server.token) as admin:
        for name in ("lan-a", "lan-b", "lan-c"):
            token = str(admin.create_join_token(600)["token"])
            creds[name] = str(admin.join_node(token, name, 4000, 8192)["credential"])
    forger = report(
        "10.9.0.66:5757",
        node_id="lan-b",
        address="10.9.0.66",
        devices=[],
        status="rejected",
        reason="bad signature: not signed with this pool's discovery key",
        source="unicast",
        rtt_ms=None,
        bandwidth_mbps=None,
    )
    with PoolClient(server.url, token=creds["lan-a"]) as a:
        a.report_peers("lan-a", [report("lan-c"), forger])
        with pytest.raises(PoolError) as e:  # only for itself: another node reads as missing
            a.report_peers("lan-b", [])
        assert e.value.status == 404
    with PoolClient(server.url, token=creds["lan-b"]) as b:
        b.report_peers("lan-b", [report("lan-c", rtt_ms=0.5, bandwidth_mbps=410.0), report("lan-a")])
    return server


def test_peers_json_merges_the_nodes_reports_by_peer(cli: Cli, reported: PoolServer) -> None:
    r = cli("peers", "--json")
    assert r.exit_code == 0, r.output
    items = json.loads(r.stdout)["items"]
    assert [(p["peer"], p["rejected"]) for p in items] == [
        ("lan-a", None),
        ("lan-c", None),
        ("10.9.0.66:5757", "bad signature: not signed with this pool's discovery key"),
    ]
    c = items[1]
    assert c["node_id"] == "lan-c" and c["address"] == "10.9.0.3" and c["port"] == 5757
    assert c["devices"] == [GPU, CPU]
    links = {s["observer"]: (s["rtt_ms"], s["bandwidth_mbps"], s["source"]) for s in c["seen_by"]}
    assert links == {"lan-a": (0.25, 940.0, "mdns"), "lan-b": (0.5, 410.0, "mdns")}
    assert all(datetime.fromisoformat(s["last_seen"]) for s in c["seen_by"])
    forger = items[2]
    assert [s["observer"] for s in forger["seen_by"]] == ["lan-a"] and forger["devices"] == []

    r = cli("peers", "--json", "--observer", "lan-b")
    assert r.exit_code == 0, r.output
    assert [(p["peer"], [s["observer"] for s in p["seen_by"]]) for p in json.loads(r.stdout)["items"]] == [
        ("lan-a", ["lan-b"]),
        ("lan-c", ["lan-b"]),
    ]


def test_peers_table(cli: Cli, reported: PoolServer) -> None:
    r = cli("peers")
    assert r.exit_code == 0, r.output
    out = r.stdout
    for text in ("PEER", "SEEN BY", "REJECTED", "lan-c", "10.9.0.3:5757", "gpu0 T4 16 GiB", "cpu cpu 8 GiB"):
        assert text in out, out
    assert "lan-a 0.25 ms 940 Mb/s (mdns)" in out and "lan-b 0.50 ms 410 Mb/s (mdns)" in out, out
    assert "bad signature" in out and "10.9.0.66:5757" in out, out


def test_peers_empty_and_bad_input(cli: Cli, reported: PoolServer) -> None:
    r = cli("peers", "--observer", "nobody")
    assert r.exit_code == 0, r.output
    assert "no peers reported" in r.stdout
    line = one_error_line(cli("peers", "--observer", "x" * 80))
    assert "observer" in line
    with PoolClient(reported.url, token=reported.token) as admin:
        node_token = str(admin.create_join_token(600)["token"])
        cred = str(admin.join_node(node_token, "lan-d", 1000, 1024)["credential"])
    line = one_error_line(cli("peers", env={"CPOOL_TOKEN": cred}))
    assert "403" in line or "may not" in line, line


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--peer", "nonsense"], "--peer"),
        (["--peer", "10.0.0.2:0"], "--peer"),
        (["--discovery", "--discovery-address", "0.0.0.0"], "--discovery-address"),
        (["--discovery", "--discovery-address", "pool.example"], "--discovery-address"),
    ],
)
def test_agent_discovery_flags_refuse_bad_values_in_one_line(cli: Cli, args: list[str], flag: str) -> None:
    line = one_error_line(cli("agent", "--server", "http://127.0.0.1:9", *args))
    assert line.startswith(f"error: {flag}:"), line
