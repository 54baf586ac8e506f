"""Discovery with real sockets on loopback: unicast peers and mDNS (real python-zeroconf) find each
other, links get measured, a node with the wrong key is rejected by everyone and never probed, and
the probe port answers nothing that is not signed with the pool's key."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest

from computepool.discovery.announce import DeviceSummary, derive_key
from computepool.discovery.links import measure_bandwidth, measure_rtt, ping_message
from computepool.discovery.runner import Discovery, DiscoveryConfig, PeerView

KEY = derive_key(b"live test secret")
WRONG = derive_key(b"not the pool's secret")
HOST = "127.0.0.1"
TIMEOUT_S = 60.0  # generous: the test machine is shared and slow; nothing here asserts on speed


def devices(gpu_mib: int) -> tuple[DeviceSummary, ...]:
    return (DeviceSummary(0, "gpu", "Test GPU", gpu_mib), DeviceSummary(0, "cpu", "cpu", 4096))


def free_port() -> int:
    """A port free for both UDP and TCP right now."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u, socket.socket() as t:
            u.bind((HOST, 0))
            port = int(u.getsockname()[1])
            try:
                t.bind((HOST, port))
            except OSError:
                continue
            return port


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def views(d: Discovery) -> dict[str, PeerView]:
    return {v.peer_key: v for v in d.snapshot()}


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


def started(stack: ExitStack, config: DiscoveryConfig) -> Discovery:
    d = Discovery(config)
    d.start()
    stack.callback(d.stop)
    return d


def test_unicast_peers_find_each_other_and_reject_the_wrong_key(stack: ExitStack) -> None:
    pa, pb, pc = free_port(), free_port(), free_port()
    common = {"mdns": False, "announce_every_s": 0.3, "measure_every_s": 60.0}
    a = started(stack, DiscoveryConfig(KEY, "node-a", HOST, pa, devices(8000), (f"{HOST}:{pb}",), **common))
    b = started(stack, DiscoveryConfig(KEY, "node-b", HOST, pb, devices(16000), (f"{HOST}:{pa}",), **common))
    impostor = started(
        stack,
        DiscoveryConfig(
            WRONG, "node-c", HOST, pc, devices(99000), (f"{HOST}:{pa}", f"{HOST}:{pb}"), **common
        ),
    )
    assert (a.port, b.port, impostor.port) == (pa, pb, pc)

    def measured(d: Discovery, peer: str) -> bool:
        v = views(d).get(peer)
        return v is not None and v.rtt_ms is not None and v.bandwidth_mbps is not None

    wait_for(
        "a and b to verify and measure each other", lambda: measured(a, "node-b") and measured(b, "node-a")
    )
    wait_for("the impostor to be rejected by both", lambda: all(f"{HOST}:{pc}" in views(d) for d in (a, b)))
    for me, other, mib in ((a, "node-b", 16000), (b, "node-a", 8000)):
        v = views(me)
        peer = v[other]
        assert peer.status == "ok" and peer.source == "unicast" and peer.port != me.port
        assert peer.devices == devices(mib)
        assert peer.rtt_ms is not None and peer.rtt_ms > 0
        assert peer.bandwidth_mbps is not None and peer.bandwidth_mbps > 0
        bad = v[f"{HOST}:{pc}"]
        assert bad.status == "rejected" and bad.reason.startswith("bad signature")
        assert (
            bad.node_id == "node-c"
            and bad.devices == ()
            and bad.rtt_ms is None
            and bad.bandwidth_mbps is None
        )
        assert set(v) == {other, f"{HOST}:{pc}"}
    # The impostor learns nothing: verified hellos only are answered, so it never hears back.
    assert all(v.status == "rejected" for v in impostor.snapshot())
    assert not any(v.node_id in ("node-a", "node-b") and v.status == "ok" for v in impostor.snapshot())


def test_probe_port_answers_only_the_pools_key(stack: ExitStack) -> None:
    d = started(stack, DiscoveryConfig(KEY, "node-p", HOST, 0, mdns=False))
    assert d.port > 0
    assert measure_rtt(KEY, HOST, HOST, d.port, count=2) is not None
    assert measure_rtt(WRONG, HOST, HOST, d.port, count=2, timeout_s=0.3) is None
    assert measure_bandwidth(KEY, HOST, HOST, d.port, size=100_000) is not None
    assert measure_bandwidth(WRONG, HOST, HOST, d.port, size=100_000, timeout_s=3.0) is None
    # A captured ping replayed with another nonce, or a stale one, gets no pong.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(0.5)
        forged = {**ping_message(KEY, "a" * 32, time.time()), "n": "b" * 32}
        stale = ping_message(KEY, "c" * 32, time.time() - 3600)
        for msg in (forged, stale):
            s.sendto(json.dumps(msg).encode(), (HOST, d.port))
            with pytest.raises(TimeoutError):
                s.recvfrom(9000)
    # Garbage of every kind is recorded as rejected, under its sender, and the loop keeps serving.
    junk = {
        b"\xff\x00": "malformed announcement: not JSON",
        b"[]": "malformed announcement: unknown message type 'None'",
        b'{"t":"hello","ann":7}': "malformed announcement: 'ann' is not an object",
        b'{"t":"hello","ann":{"pool":"x"}}': "malformed announcement: 'node_id'",
        b'{"t":"what"}': "malformed announcement: unknown message type 'what'",
        b"x" * 9000: "malformed announcement: datagram over 8192 bytes",
    }
    expected = {}
    for data, reason in junk.items():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((HOST, 0))
            s.sendto(data, (HOST, d.port))
            expected[f"{HOST}:{s.getsockname()[1]}"] = reason
    wait_for("garbage recorded", lambda: set(expected) <= set(views(d)))
    got = views(d)
    assert {k: got[k].reason for k in expected} == expected
    assert all(got[k].status == "rejected" for k in expected)
    assert measure_rtt(KEY, HOST, HOST, d.port, count=1) is not None


def test_stop_is_idempotent_and_frees_the_port() -> None:
    port = free_port()
    d = Discovery(DiscoveryConfig(KEY, "node-s", HOST, port, mdns=False))
    d.start()
    d.stop()
    d.stop()
    again = Discovery(DiscoveryConfig(KEY, "node-s", HOST, port, mdns=False))
    again.start()
    again.stop()


def test_bad_configuration_fails_in_words() -> None:
    with pytest.raises(ValueError, match="not HOST:PORT"):
        Discovery(DiscoveryConfig(KEY, "node-x", HOST, peers=("nowhere",)))
    with pytest.raises(ValueError, match="node id"):
        Discovery(DiscoveryConfig(KEY, "Bad Name", HOST))


def test_mdns_peers_find_each_other_on_loopback(stack: ExitStack) -> None:
    common = {"mdns": True, "announce_every_s": 0.5, "measure_every_s": 60.0}
    a = started(stack, DiscoveryConfig(KEY, "mdns-a", HOST, 0, devices(1000), **common))
    b = started(stack, DiscoveryConfig(KEY, "mdns-b", HOST, 0, devices(2000), **common))
    impostor = started(stack, DiscoveryConfig(WRONG, "mdns-c", HOST, 0, devices(3000), **common))
    bad_key = f"{HOST}:{impostor.port}"

    def found(d: Discovery, peer: str) -> bool:
        v = views(d).get(peer)
        return v is not None and v.rtt_ms is not None

    wait_for("mDNS discovery both ways", lambda: found(a, "mdns-b") and found(b, "mdns-a"))
    wait_for("the impostor rejected over mDNS", lambda: all(bad_key in views(d) for d in (a, b)))
    for me, other, mib in ((a, "mdns-b", 2000), (b, "mdns-a", 1000)):
        v = views(me)
        assert v[other].status == "ok" and v[other].source == "mdns" and v[other].devices == devices(mib)
        assert v[bad_key].status == "rejected" and v[bad_key].reason.startswith("bad signature")
        assert v[bad_key].source == "mdns" and v[bad_key].rtt_ms is None
    # Announcements keep arriving (re-signed with a fresh time): last_seen moves on.
    first = views(a)["mdns-b"].last_seen
    wait_for("a fresh mDNS announcement", lambda: views(a)["mdns-b"].last_seen > first)
    stopper = threading.Thread(target=a.stop, daemon=True)
    stopper.start()
    stopper.join(120)  # a generous deadline: a stop that hangs would hang here for good
    assert not stopper.is_alive(), "stopping discovery hung"


def test_copied_identity_restart_and_expiry_over_the_wire(stack: ExitStack) -> None:
    pa = free_port()
    fast = {"mdns": False, "announce_every_s": 0.3, "measure_every_s": 60.0, "expire_after_s": 3.0}
    a = started(stack, DiscoveryConfig(KEY, "node-a", HOST, pa, **fast))
    to_a = (f"{HOST}:{pa}",)

    # A restart: node-b stops and comes back as a new instance; a believes the new one, no flag.
    b1 = started(stack, DiscoveryConfig(KEY, "node-b", HOST, 0, devices(1), to_a, **fast))
    wait_for("b's first instance", lambda: views(a).get("node-b") is not None)
    assert views(a)["node-b"].instance == b1.instance
    b1.stop()
    b2 = started(stack, DiscoveryConfig(KEY, "node-b", HOST, 0, devices(2), to_a, **fast))
    wait_for("b's second instance", lambda: getattr(views(a).get("node-b"), "instance", "") == b2.instance)
    time.sleep(1.0)
    assert views(a)["node-b"].status == "ok" and views(a)["node-b"].devices == devices(2)

    # A copy: a second live agent announcing node-b; both are shown rejected, neither is trusted.
    copy = started(stack, DiscoveryConfig(KEY, "node-b", HOST, 0, devices(3), to_a, **fast))
    wait_for("the copied identity flagged", lambda: "node-b" not in views(a))
    flagged = {v.peer_key: v for v in a.snapshot() if v.node_id == "node-b"}
    assert set(flagged) == {f"{HOST}:{b2.port}", f"{HOST}:{copy.port}"}
    for v in flagged.values():
        assert (
            v.status == "rejected"
            and "duplicate node id node-b" in v.reason
            and "copied identity" in v.reason
        )
        assert b2.instance in v.reason and copy.instance in v.reason

    # The copy goes away: after expiry node-b is believed again, then it too expires when stopped.
    copy.stop()
    wait_for("node-b trusted again", lambda: getattr(views(a).get("node-b"), "status", "") == "ok")
    b2.stop()
    wait_for("node-b expired", lambda: a.snapshot() == [])
