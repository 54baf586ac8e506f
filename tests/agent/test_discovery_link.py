"""The agent's discovery link against real HTTP servers: a control plane without discovery (HTTP 404)
costs one log line and no discovery; one that answers gets the key fetched, discovery started on
the announced address and the view PUT as the wire's NodePeersIn; what the agent announces of its
devices, and the address it picks when told none."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from computepool.agent.api import AgentApi
from computepool.agent.config import DiscoveryOptions
from computepool.agent.devices import discover_all
from computepool.agent.discovery_link import DiscoveryLink, device_summaries, peer_reports, route_address
from computepool.discovery.announce import derive_key, fingerprint
from computepool.discovery.registry import PeerView
from computepool.wire.peers import NodePeersIn

KEY = derive_key(b"the test pool's discovery secret")


class FakePlane:
    """A real HTTP server standing for the control plane's two discovery routes."""

    def __init__(self, has_discovery: bool) -> None:
        self.reports: list[dict[str, Any]] = []
        self.key_calls = 0
        plane = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                if self.path == "/api/v1/discovery/key":
                    plane.key_calls += 1
                    if has_discovery:
                        self._answer(200, {"key": KEY.hex(), "fingerprint": fingerprint(KEY)})
                        return
                self._answer(404, {"error": "not found"})

            def do_PUT(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                plane.reports.append({"path": self.path, "body": body})
                self._answer(200, {"items": []})

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def plane(request: pytest.FixtureRequest) -> Iterator[FakePlane]:
    p = FakePlane(has_discovery=request.param)
    yield p
    p.close()


def _link(plane: FakePlane, **options: Any) -> tuple[DiscoveryLink, AgentApi]:
    api = AgentApi(plane.url)
    inventory = discover_all("1xT4-16GB", seed="n1")
    opts = DiscoveryOptions(address="127.0.0.1", port=0, mdns=False, **{"report_every_s": 0.2, **options})
    return DiscoveryLink(api, "n1", "127.0.0.1", device_summaries(inventory), opts), api


@pytest.mark.parametrize("plane", [False], indirect=True)
def test_an_older_control_plane_means_no_discovery(
    plane: FakePlane, caplog: pytest.LogCaptureFixture
) -> None:
    link, api = _link(plane)
    with caplog.at_level(logging.WARNING, "computepool.agent"):
        link.start()
        link._thread.join(timeout=30)
        assert not link._thread.is_alive()
    link.close()
    api.close()
    assert plane.key_calls == 1 and link.discovery is None and plane.reports == []
    assert [r.getMessage() for r in caplog.records] == [
        "discovery: the control plane has no discovery (an older version); running without"
    ]


@pytest.mark.parametrize("plane", [True], indirect=True)
def test_the_link_fetches_the_key_runs_discovery_and_reports(
    plane: FakePlane, caplog: pytest.LogCaptureFixture
) -> None:
    link, api = _link(plane, refresh_every_s=0.2)
    with caplog.at_level(logging.DEBUG, "computepool"):
        link.start()
        deadline = time.monotonic() + 60
        while len(plane.reports) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        d = link.discovery
        assert d is not None and d.port > 0
        ann = d.announcement()
        assert (ann.address, ann.node_id, ann.pool) == ("127.0.0.1", "n1", fingerprint(KEY))
        link.close()
        link.close()  # idempotent
    api.close()
    assert len(plane.reports) >= 2, "no reports"
    assert {r["path"].split("?")[0] for r in plane.reports} == {"/api/v1/nodes/n1/peers"}
    for r in plane.reports:  # the node's clock when it sent it: the server corrects last_seen by it
        (sent,) = parse_qs(urlsplit(r["path"]).query)["sent_at"]
        assert datetime.fromisoformat(sent).tzinfo is not None
    for r in plane.reports:
        NodePeersIn.model_validate(r["body"])  # the wire type the server parses
    assert KEY.hex() not in caplog.text  # the key is a secret


@pytest.mark.parametrize("plane", [True], indirect=True)
def test_an_unchanged_view_is_not_sent_again_at_once(plane: FakePlane) -> None:
    link, api = _link(plane, refresh_every_s=3600.0)
    link.start()
    deadline = time.monotonic() + 60
    while not plane.reports and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.5)  # several report rounds
    link.close()
    api.close()
    assert [r["body"] for r in plane.reports] == [{"peers": []}]


def test_what_a_node_announces_and_reports_is_the_wire_type() -> None:
    inventory = discover_all("2xA100-80GB", seed="n1")
    devices = device_summaries(inventory)
    assert [(d.kind, d.index) for d in devices] == [("gpu", 0), ("gpu", 1), ("cpu", 0)]
    assert devices[-1].memory_mib == inventory.cpu.memory_mib > 0
    now = time.time()
    views = [
        PeerView("10.0.0.9:5757", "x", "i" * 16, "10.0.0.9", 5757, (), "rejected", "r" * 900, "unicast",
                 None, None, now),
        PeerView("n2", "n2", "0" * 16, "10.0.0.2", 5757, devices, "ok", "", "mdns", 0.3, 850.0, now),
    ]  # fmt: skip
    body = NodePeersIn.model_validate({"peers": peer_reports(views)})
    assert [p.peer_key for p in body.peers] == ["n2", "10.0.0.9:5757"]  # verified ones first
    assert len(body.peers[1].reason) == 512 and body.peers[0].devices[0].kind == "gpu"
    assert abs(body.peers[0].last_seen.timestamp() - now) < 1e-3


def test_the_default_address_is_the_route_to_the_server() -> None:
    assert route_address("http://127.0.0.1:8470") == "127.0.0.1"
    assert route_address("https://[::1]:8470") == "127.0.0.1"  # not IPv4: loopback, never 0.0.0.0
