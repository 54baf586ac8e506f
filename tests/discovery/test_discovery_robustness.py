"""Discovery under hostile or odd conditions, with real sockets and real python-zeroconf on
loopback: peers the prober cannot reach, pongs from the wrong node or socket, strangers trickling
bytes at the bandwidth port, an mDNS flood of junk names, secrets in reprs, and the peer report's
address and node id checks."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from datetime import UTC, datetime

import pytest
from pydantic import ValidationError
from zeroconf import IPVersion, ServiceInfo, Zeroconf

from computepool.discovery.announce import SERVICE_TYPE, Announcement, derive_key, fingerprint
from computepool.discovery.links import answer_ping, measure_bandwidth, measure_rtt
from computepool.discovery.mdns import MdnsTransport
from computepool.discovery.registry import Registry
from computepool.discovery.runner import Discovery, DiscoveryConfig, PeerView
from computepool.wire.peers import NodePeersIn, PeerReport

KEY = derive_key(b"robustness test secret")
WRONG = derive_key(b"a stranger's secret")
HOST = "127.0.0.1"
STRANGER = "127.0.0.2"  # another source address on loopback: a different host as the server sees it
TIMEOUT_S = 60.0  # generous: the machine is shared and slow; nothing here asserts on speed


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


def hello(key: bytes, node_id: str, address: str, port: int) -> bytes:
    ann = Announcement(fingerprint(key), node_id, "feedfacefeedface", address, port, time.time()).signed(key)
    return json.dumps({"t": "hello", "ann": ann.to_json()}).encode()


# -- finding 4: the link prober outlives peers it cannot reach ---------------------------------


def test_unreachable_addresses_are_no_link_not_an_error() -> None:
    assert measure_rtt(KEY, HOST, "::1", 9, count=1, timeout_s=0.2) is None  # another family
    assert measure_rtt(KEY, HOST, "10.255.255.1", 9, count=1, timeout_s=0.2) is None  # EINVAL
    assert measure_rtt(KEY, HOST, "no-such-host.invalid", 9, count=1, timeout_s=0.2) is None


def test_the_prober_keeps_measuring_after_a_peer_it_cannot_reach(stack: ExitStack) -> None:
    fast = {"mdns": False, "announce_every_s": 0.3, "measure_every_s": 60.0}
    a = started(stack, DiscoveryConfig(KEY, "node-a", HOST, 0, **fast))
    # Key holders announcing addresses a 127.0.0.1-bound prober cannot send to.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(hello(KEY, "node-far", "10.255.255.1", 9), (HOST, a.port))
        s.sendto(hello(KEY, "node-six", "::1", 9), (HOST, a.port))
    wait_for("the odd peers listed", lambda: {"node-far", "node-six"} <= set(views(a)))
    time.sleep(1.0)  # the prober has tried them
    b = started(stack, DiscoveryConfig(KEY, "node-b", HOST, 0, peers=(f"{HOST}:{a.port}",), **fast))

    def measured() -> bool:
        v = views(a).get("node-b")
        return v is not None and v.rtt_ms is not None and v.bandwidth_mbps is not None

    wait_for("a to measure b after the unreachable peers", measured)
    assert views(a)["node-far"].rtt_ms is None and views(a)["node-six"].rtt_ms is None
    assert b.port != a.port


# -- finding 12: a pong proves which node answered, from where it was asked -------------------


def test_pongs_and_transfers_name_the_node_that_answered(stack: ExitStack) -> None:
    c = started(stack, DiscoveryConfig(KEY, "node-c", HOST, 0, mdns=False))
    rtt = measure_rtt(KEY, HOST, HOST, c.port, count=2, node_id="node-c", instance=c.instance)
    assert rtt is not None
    for node_id, instance in (("node-b", c.instance), ("node-c", "0000000000000000"), ("node-b", "")):
        assert (
            measure_rtt(KEY, HOST, HOST, c.port, count=1, timeout_s=0.3, node_id=node_id, instance=instance)
            is None
        )
    assert measure_bandwidth(KEY, HOST, HOST, c.port, size=50_000, node_id="node-c", instance=c.instance)
    assert (
        measure_bandwidth(KEY, HOST, HOST, c.port, size=50_000, node_id="node-b", instance=c.instance) is None
    )


def test_a_pong_from_another_socket_is_not_taken() -> None:
    """A key holder answering correctly, but from a socket other than the one pinged: not the peer."""
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as pinged,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other,
    ):
        pinged.bind((HOST, 0))
        other.bind((HOST, 0))
        port = pinged.getsockname()[1]

        def responder(answer_from: socket.socket) -> None:
            pinged.settimeout(5.0)
            try:
                data, source = pinged.recvfrom(9000)
            except TimeoutError:
                return
            pong = answer_ping(KEY, json.loads(data), time.time(), node_id="node-r", instance="r1")
            assert pong is not None
            answer_from.sendto(json.dumps(pong).encode(), source)

        for answer_from, expect_link in ((pinged, True), (other, False)):
            t = threading.Thread(target=responder, args=(answer_from,))
            t.start()
            rtt = measure_rtt(KEY, HOST, HOST, port, count=1, timeout_s=2.0, node_id="node-r", instance="r1")
            t.join()
            assert (rtt is not None) == expect_link


# -- finding 5: strangers cannot hold the bandwidth port ---------------------------------------


def _trickle(port: int, closed: list[float], stop: threading.Event) -> None:
    """Send one byte of a request line every 0.5 s from STRANGER; note when the server hangs up."""
    started = time.monotonic()
    with socket.create_connection((HOST, port), timeout=5.0, source_address=(STRANGER, 0)) as s:
        s.settimeout(0.5)
        while not stop.is_set() and time.monotonic() - started < 30.0:
            try:
                s.send(b"{")
                if s.recv(1) == b"":
                    break
            except TimeoutError:
                continue
            except OSError:
                break
        else:
            return
        closed.append(time.monotonic() - started)


def test_trickling_strangers_neither_hold_slots_nor_block_members(stack: ExitStack) -> None:
    d = started(stack, DiscoveryConfig(KEY, "node-d", HOST, 0, mdns=False))
    closed: list[float] = []
    stop = threading.Event()
    stack.callback(stop.set)
    tricklers = [threading.Thread(target=_trickle, args=(d.port, closed, stop)) for _ in range(2)]
    for t in tricklers:
        t.start()
        stack.callback(t.join)
    time.sleep(0.5)  # both connected and trickling
    got = measure_bandwidth(KEY, HOST, HOST, d.port, size=100_000, node_id="node-d", instance=d.instance)
    assert got is not None and got > 0
    wait_for("both trickling connections cut", lambda: len(closed) == 2, timeout_s=30.0)
    assert max(closed) < 25.0


def test_nodes_sharing_one_address_all_get_their_transfers(stack: ExitStack) -> None:
    """One transfer slot per source address: three nodes on one loopback take turns, none starves."""
    fast = {"mdns": False, "announce_every_s": 0.3, "measure_every_s": 60.0}
    first = started(stack, DiscoveryConfig(KEY, "node-0", HOST, 0, **fast))
    to_first = (f"{HOST}:{first.port}",)
    nodes = [first] + [
        started(stack, DiscoveryConfig(KEY, f"node-{i}", HOST, 0, peers=to_first, **fast)) for i in (1, 2)
    ]

    def all_measured() -> bool:
        got = {(me.config.node_id, k) for me in nodes for k, v in views(me).items() if v.bandwidth_mbps}
        return len(got) >= 4 and all(("node-0", f"node-{i}") in got for i in (1, 2))

    wait_for("node-0 and the others to measure bandwidth both ways", all_measured)


# -- finding 6: an mDNS flood of junk names does not lock genuine peers out -------------------


def test_junk_mdns_names_do_not_lock_out_a_genuine_peer(stack: ExitStack) -> None:
    stop = threading.Event()
    registry = Registry(KEY, node_id="observer", instance="0bse7ve70bse7ve7", started_at=time.time())

    def mine() -> Announcement:
        return Announcement(fingerprint(KEY), "observer", "0bse7ve70bse7ve7", HOST, 9, time.time()).signed(
            KEY
        )

    observer = MdnsTransport(
        address=HOST, registry=registry, announcement=mine, announce_every_s=0.5, stop=stop, max_names=3
    )
    observer.start()
    stack.callback(observer.close)
    stack.callback(stop.set)
    junk = Zeroconf(interfaces=[HOST], ip_version=IPVersion.V4Only)
    stack.callback(junk.close)
    for i in range(5):  # more junk names than the observer polls at once
        ann = Announcement(fingerprint(WRONG), f"junk-{i}", f"junk{i}", HOST, 7000 + i, time.time())
        junk.register_service(
            ServiceInfo(
                SERVICE_TYPE,
                f"cpool-junk{i}.{SERVICE_TYPE}",
                addresses=[socket.inet_aton(HOST)],
                port=7000 + i,
                properties=ann.signed(WRONG).to_txt(),
                server=f"cpool-junk{i}.local.",
            ),
            cooperating_responders=True,
        )

    def rejected() -> int:
        return sum(v.status == "rejected" for v in registry.snapshot(time.time()))

    wait_for("the junk rejected", lambda: rejected() >= 3)
    started(stack, DiscoveryConfig(KEY, "mdns-good", HOST, 0, mdns=True, announce_every_s=0.5))

    def good() -> bool:
        return any(v.peer_key == "mdns-good" and v.status == "ok" for v in registry.snapshot(time.time()))

    wait_for("the genuine peer found despite the junk", good, timeout_s=40.0)  # junk goes stale at 60 s


# -- finding 15: the key stays out of reprs ----------------------------------------------------


def test_the_key_is_not_in_the_config_repr() -> None:
    text = repr(DiscoveryConfig(KEY, "node-r", HOST))
    assert "node-r" in text and KEY.hex() not in text and repr(KEY) not in text and "key=" not in text


# -- finding 14: what an agent reports is checked at the edge ----------------------------------


def report(**kw: object) -> dict[str, object]:
    body: dict[str, object] = {
        "peer_key": "10.0.0.5:5757",
        "status": "rejected",
        "source": "unicast",
        "last_seen": datetime.now(UTC).isoformat(),
    }
    return {**body, **kw}


@pytest.mark.parametrize("address", ["10.0.0.5", "fe80::1", "", "192.168.1.20"])
def test_a_report_address_is_an_ip_or_empty(address: str) -> None:
    assert PeerReport.model_validate(report(address=address)).address == address


@pytest.mark.parametrize(
    "address", ["10.0.0.5,10.0.0.6", "10.0.0.5:50052", "peer.example", "?", "fe80::1%eth0", "fe80::1%a,b"]
)
def test_a_report_address_that_is_not_an_ip_is_refused(address: str) -> None:
    with pytest.raises(ValidationError) as e:
        NodePeersIn.model_validate({"peers": [report(address=address)]})
    [err] = e.value.errors()
    assert err["loc"] == ("peers", 0, "address") and "IP address" in err["msg"]


@pytest.mark.parametrize("node_id", ["Node-A", "a,b", "-x", "x" * 64, ""])
def test_a_report_node_id_is_a_node_name(node_id: str) -> None:
    with pytest.raises(ValidationError) as e:
        PeerReport.model_validate(report(node_id=node_id))
    assert e.value.errors()[0]["loc"] == ("node_id",)
    assert PeerReport.model_validate(report(node_id="node-a.1_b")).node_id == "node-a.1_b"
