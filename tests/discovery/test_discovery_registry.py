"""The peer table's trust rules, driven with explicit clocks: verified vs rejected, forgeries that
cannot evict the real entry, copied identities vs restarts, expiry, and our own echo."""

from __future__ import annotations

import dataclasses

import pytest

from computepool.discovery.announce import Announcement, DeviceSummary, derive_key, fingerprint
from computepool.discovery.registry import Registry

KEY = derive_key(b"registry test secret")
WRONG = derive_key(b"somebody else")
T0 = 1_800_000_000.0
GPU = (DeviceSummary(0, "gpu", "NVIDIA H200", 143771),)


def ann(
    node_id: str, instance: str, at: float, *, key: bytes = KEY, address: str = "10.0.0.2"
) -> Announcement:
    return Announcement(fingerprint(KEY), node_id, instance, address, 5757, at, GPU).signed(key)


@pytest.fixture
def registry() -> Registry:
    return Registry(KEY, node_id="me", instance="mine", started_at=T0, expire_after_s=30.0)


def by_key(reg: Registry, now: float) -> dict[str, tuple[str, str]]:
    return {v.peer_key: (v.status, v.reason) for v in reg.snapshot(now)}


def test_verified_peer_is_listed_with_its_devices(registry: Registry) -> None:
    assert registry.observe(ann("b", "i1", T0), source="unicast", sender=("10.0.0.2", 5757), now=T0) is None
    [view] = registry.snapshot(T0 + 1)
    assert (view.peer_key, view.node_id, view.status, view.reason) == ("b", "b", "ok", "")
    assert view.devices == GPU and view.address == "10.0.0.2" and view.port == 5757
    assert view.source == "unicast" and view.last_seen == T0


def test_forgery_is_rejected_by_sender_and_never_evicts_the_real_entry(registry: Registry) -> None:
    registry.observe(ann("b", "i1", T0), source="mdns", sender=("10.0.0.2", 5757), now=T0)
    forged = ann("b", "evil", T0 + 1, key=WRONG, address="10.0.0.66")
    reason = registry.observe(forged, source="unicast", sender=("10.0.0.66", 4000), now=T0 + 1)
    assert reason is not None and reason.startswith("bad signature")
    views = {v.peer_key: v for v in registry.snapshot(T0 + 2)}
    assert views["b"].status == "ok" and views["b"].instance == "i1" and views["b"].address == "10.0.0.2"
    bad = views["10.0.0.66:4000"]
    assert bad.status == "rejected" and bad.reason.startswith("bad signature")
    assert bad.node_id == "b" and bad.devices == ()  # the claim is shown, its devices are not believed
    # A forged "newer" announcement of b's own instance (tampered issued_at) refreshes nothing.
    tampered = dataclasses.replace(ann("b", "i1", T0), issued_at=T0 + 25)
    registry.observe(tampered, source="unicast", sender=("10.0.0.66", 4000), now=T0 + 25)
    assert "b" not in by_key(registry, T0 + 31)  # b last really heard at T0: expired


def test_malformed_input_is_rejected_and_capped() -> None:
    reg = Registry(KEY, node_id="me", instance="mine", started_at=T0, max_rejected=3)
    for i in range(5):
        reason = reg.observe(
            ValueError("not JSON"), source="unicast", sender=("10.0.0.9", 1000 + i), now=T0 + i
        )
        assert reason == "malformed announcement: not JSON"
    views = reg.snapshot(T0 + 5)
    assert [v.peer_key for v in views] == ["10.0.0.9:1004", "10.0.0.9:1003", "10.0.0.9:1002"]
    assert all(v.status == "rejected" and v.node_id is None for v in views)


def test_copied_identity_is_flagged_when_both_keep_announcing(registry: Registry) -> None:
    registry.observe(ann("b", "one", T0), source="unicast", sender=("10.0.0.2", 5757), now=T0)
    registry.observe(
        ann("b", "two", T0 + 1, address="10.0.0.3"), source="unicast", sender=("10.0.0.3", 5757), now=T0 + 1
    )
    assert by_key(registry, T0 + 1) == {"b": ("ok", "")}  # could still be a restart
    registry.observe(ann("b", "one", T0 + 2), source="unicast", sender=("10.0.0.2", 5757), now=T0 + 2)
    views = registry.snapshot(T0 + 3)
    assert {v.peer_key for v in views} == {"10.0.0.2:5757", "10.0.0.3:5757"}
    for v in views:
        assert v.status == "rejected" and v.node_id == "b" and v.devices == () and v.rtt_ms is None
        assert v.reason.startswith("duplicate node id b: instance one at 10.0.0.2:5757 and instance two")
        assert "copied identity" in v.reason
    assert registry.targets(T0 + 3) == []  # neither is measured
    # Once one copy goes silent, the other is believed again after it expires.
    registry.observe(
        ann("b", "two", T0 + 20, address="10.0.0.3"), source="unicast", sender=("10.0.0.3", 5757), now=T0 + 20
    )
    assert by_key(registry, T0 + 40) == {"b": ("ok", "")}


def test_restart_is_not_flagged_even_with_the_old_announcements_replayed(registry: Registry) -> None:
    old = [ann("b", "old", T0 + i) for i in range(3)]
    for i, a in enumerate(old):
        registry.observe(a, source="unicast", sender=("10.0.0.2", 5757), now=T0 + i)
    registry.observe(ann("b", "new", T0 + 10), source="unicast", sender=("10.0.0.2", 5757), now=T0 + 10)
    for i, a in enumerate(old):  # an attacker (or a cache) replays the old instance's announcements
        registry.observe(a, source="unicast", sender=("10.0.0.66", 9), now=T0 + 11 + i)
    registry.observe(ann("b", "new", T0 + 15), source="unicast", sender=("10.0.0.2", 5757), now=T0 + 15)
    [view] = registry.snapshot(T0 + 16)
    assert (view.peer_key, view.status, view.instance) == ("b", "ok", "new")
    assert registry.targets(T0 + 16)[0].instance == "new"


def test_another_instance_of_our_own_id_is_flagged(registry: Registry) -> None:
    # A leftover announcement of our previous run (signed before we started) is not a copy.
    registry.observe(ann("me", "previous", T0 - 5), source="mdns", sender=("10.0.0.1", 5757), now=T0 + 1)
    assert by_key(registry, T0 + 1) == {}  # nor is it listed as a peer: it is us
    assert registry.targets(T0 + 1) == []
    registry.observe(ann("me", "copy", T0 + 2), source="mdns", sender=("10.0.0.8", 5757), now=T0 + 2)
    [view] = registry.snapshot(T0 + 3)  # the leftover is not part of it
    assert (view.peer_key, view.instance, view.status) == ("10.0.0.8:5757", "copy", "rejected")
    assert view.reason.startswith("duplicate node id me: instance mine at this node and instance copy")


def test_own_instance_is_ignored(registry: Registry) -> None:
    assert registry.observe(ann("me", "mine", T0), source="mdns", sender=("10.0.0.1", 5757), now=T0) is None
    assert registry.snapshot(T0) == []


def test_entries_expire_unless_really_heard(registry: Registry) -> None:
    a = ann("b", "i1", T0)
    registry.observe(a, source="unicast", sender=("10.0.0.2", 5757), now=T0)
    registry.observe(ValueError("x"), source="unicast", sender=("10.0.0.9", 1), now=T0)
    for t in (10, 20, 29):  # the same announcement again (a replay, a cache) is no sign of life
        registry.observe(a, source="mdns", sender=("10.0.0.2", 5757), now=T0 + t)
    assert "b" in by_key(registry, T0 + 29)
    assert by_key(registry, T0 + 31) == {}
    registry.observe(ann("b", "i1", T0 + 40), source="unicast", sender=("10.0.0.2", 5757), now=T0 + 40)
    assert by_key(registry, T0 + 65) == {"b": ("ok", "")}


def test_links_are_kept_per_instance_and_cleared_on_a_move(registry: Registry) -> None:
    registry.observe(ann("b", "i1", T0), source="unicast", sender=("10.0.0.2", 5757), now=T0)
    assert [t.measured for t in registry.targets(T0)] == [False]
    registry.set_link("b", "i1", 0.4, 900.0)
    registry.set_link("b", "gone", 1.0, 1.0)  # an unknown instance changes nothing
    [view] = registry.snapshot(T0)
    assert (view.rtt_ms, view.bandwidth_mbps) == (0.4, 900.0)
    registry.observe(
        ann("b", "i1", T0 + 1, address="10.0.0.7"), source="unicast", sender=("10.0.0.7", 5757), now=T0 + 1
    )
    [view] = registry.snapshot(T0 + 1)
    assert view.address == "10.0.0.7" and view.rtt_ms is None


def test_a_sender_that_verifies_clears_its_old_rejection(registry: Registry) -> None:
    stale = ann("b", "i1", T0 - 500)
    assert "stale" in (registry.observe(stale, source="unicast", sender=("10.0.0.2", 5757), now=T0) or "")
    registry.observe(ann("b", "i1", T0), source="unicast", sender=("10.0.0.2", 5757), now=T0)
    assert by_key(registry, T0) == {"b": ("ok", "")}


def test_a_replayed_announcement_does_not_bring_a_departed_peer_back(registry: Registry) -> None:
    last = ann("b", "i1", T0 + 5)
    registry.observe(ann("b", "i1", T0), source="unicast", sender=("10.0.0.2", 5757), now=T0)
    registry.observe(last, source="unicast", sender=("10.0.0.2", 5757), now=T0 + 5)
    assert "b" not in by_key(registry, T0 + 40)  # silent for over 30 s: gone
    # Its last genuine announcement replayed (still within MAX_SKEW_S, so it verifies): ignored.
    for at in (T0 + 41, T0 + 70, T0 + 100):
        assert registry.observe(last, source="unicast", sender=("10.0.0.9", 1), now=at) is None
        assert by_key(registry, at) == {}
    # A genuinely new announcement of that instance (it was only cut off) is believed again.
    registry.observe(ann("b", "i1", T0 + 101), source="unicast", sender=("10.0.0.2", 5757), now=T0 + 101)
    assert by_key(registry, T0 + 102) == {"b": ("ok", "")}


def test_instances_of_one_node_id_are_capped(registry: Registry) -> None:
    for i in range(10):  # a key holder minting instances of node b, all still announcing
        for j in range(i + 1):
            registry.observe(
                ann("b", f"i{j}", T0 + i + j / 100),
                source="unicast",
                sender=("10.0.0.2", 6000 + j),
                now=T0 + i + j / 100,
            )
    flagged = [v for v in registry.snapshot(T0 + 10) if v.node_id == "b"]
    assert flagged and all(v.status == "rejected" and "duplicate node id b" in v.reason for v in flagged)
    assert len(flagged) == 4
    assert {v.instance for v in flagged} == {"i6", "i7", "i8", "i9"}  # the most recently heard stay


def test_a_scoped_ipv6_address_is_malformed(registry: Registry) -> None:
    scoped = ann("b", "i1", T0, address="fe80::1%eth0,10.0.0.9:50052")
    reason = registry.observe(scoped, source="unicast", sender=("10.0.0.2", 5757), now=T0)
    assert reason is not None and reason.startswith("malformed announcement: address")
    [view] = registry.snapshot(T0)
    assert (view.status, view.address, view.devices) == ("rejected", "10.0.0.2", ())
