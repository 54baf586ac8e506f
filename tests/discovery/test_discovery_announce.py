"""Signed announcements: every field is covered by the signature, other keys and pools are told
apart, replays and future-dated ones are refused, and both wire forms round-trip."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from computepool.discovery.announce import (
    MAX_SKEW_S,
    Announcement,
    DeviceSummary,
    derive_key,
    fingerprint,
    new_instance,
    verify,
)
from computepool.discovery.bench import auth_cost

KEY = derive_key(b"pool secret one")
OTHER = derive_key(b"pool secret two")


def announcement(key: bytes = KEY, **changes: object) -> Announcement:
    base = Announcement(
        pool=fingerprint(key),
        node_id="node-a",
        instance=new_instance(),
        address="10.0.0.5",
        port=5757,
        issued_at=time.time(),
        devices=(DeviceSummary(0, "gpu", "NVIDIA H200", 143771), DeviceSummary(0, "cpu", "cpu", 64000)),
    )
    return dataclasses.replace(base, **changes).signed(key)  # type: ignore[arg-type]


def test_genuine_announcement_verifies() -> None:
    assert verify(announcement(), KEY, time.time()) is None


def test_derived_key_is_not_the_secret_and_differs_per_secret() -> None:
    assert KEY != b"pool secret one" and len(KEY) == 32 and KEY != OTHER
    assert fingerprint(KEY) != fingerprint(OTHER)


@pytest.mark.parametrize(
    "field,value",
    [
        ("node_id", "node-b"),
        ("instance", "ffffffffffffffff"),
        ("address", "10.0.0.6"),
        ("port", 5758),
        ("issued_at", "later"),
        ("devices", (DeviceSummary(0, "gpu", "NVIDIA H200", 999999),)),
        ("devices", ()),
    ],
)
def test_tampering_with_any_field_breaks_the_signature(field: str, value: object) -> None:
    ann = announcement()
    if value == "later":
        value = ann.issued_at + 1.0
    forged = dataclasses.replace(ann, **{field: value})  # type: ignore[arg-type]
    reason = verify(forged, KEY, time.time())
    assert reason is not None and reason.startswith("bad signature"), reason


def test_tampered_version_and_pool_are_rejected() -> None:
    ann = announcement()
    assert "version" in (verify(dataclasses.replace(ann, version="2"), KEY, time.time()) or "")
    other_pool = dataclasses.replace(ann, pool=fingerprint(OTHER))
    assert "another pool" in (verify(other_pool, KEY, time.time()) or "")


def test_wrong_key_claiming_this_pool_is_a_bad_signature() -> None:
    forged = dataclasses.replace(announcement(), signature="").signed(OTHER)  # pool field still ours
    assert verify(forged, KEY, time.time()) == "bad signature: not signed with this pool's discovery key"


def test_another_pools_node_is_named_as_such() -> None:
    theirs = announcement(OTHER)
    reason = verify(theirs, KEY, time.time())
    assert reason is not None
    assert reason.startswith("bad signature") and fingerprint(OTHER) in reason and "another pool" in reason
    assert verify(theirs, OTHER, time.time()) is None


def test_unsigned_and_garbage_signatures() -> None:
    ann = announcement()
    assert verify(dataclasses.replace(ann, signature=""), KEY, time.time()) == "unsigned announcement"
    assert "not base64" in (verify(dataclasses.replace(ann, signature="@@@"), KEY, time.time()) or "")


def test_stale_and_future_announcements_are_refused() -> None:
    now = time.time()
    stale = announcement(issued_at=now - MAX_SKEW_S - 5)
    future = announcement(issued_at=now + MAX_SKEW_S + 5)
    assert "stale announcement" in (verify(stale, KEY, now) or "")
    assert "from the future" in (verify(future, KEY, now) or "")
    assert verify(announcement(issued_at=now - MAX_SKEW_S + 5), KEY, now) is None


def test_json_and_txt_round_trip() -> None:
    ann = announcement()
    via_json = Announcement.from_json(json.loads(json.dumps(ann.to_json())))
    assert via_json == ann and verify(via_json, KEY, time.time()) is None
    txt = ann.to_txt()
    assert all(len(v.encode()) <= 255 for v in txt.values())
    as_bytes = {k.encode(): v.encode() for k, v in txt.items()}  # what zeroconf hands back
    via_txt = Announcement.from_txt(as_bytes)
    assert via_txt == ann and verify(via_txt, KEY, time.time()) is None


@pytest.mark.parametrize(
    "change,words",
    [
        ({"port": "x"}, "malformed announcement"),
        ({"port": 0}, "port 0"),
        ({"node_id": "Not A Name"}, "node id"),
        ({"devices": "0:gpu:1:x"}, "devices must be a list"),
        ({"devices": ["0:tpu:1:x"]}, "bad device"),
        ({"devices": ["0:gpu:-1:x"]}, "out of range"),
        ({"address": "not-an-ip"}, "address"),
        ({"instance": "x" * 200}, "instance"),
        ({"issued_at": "nan"}, "finite"),
        ({"pool": "p" * 300}, "pool"),
    ],
)
def test_malformed_json_names_what_is_wrong(change: dict[str, object], words: str) -> None:
    body = {**announcement().to_json(), **change}
    with pytest.raises(ValueError) as err:
        Announcement.from_json(body)
    assert str(err.value).startswith("malformed announcement") and words in str(err.value)
    assert len(str(err.value)) < 200


def test_malformed_json_missing_field() -> None:
    body = announcement().to_json()
    del body["node_id"]
    with pytest.raises(ValueError, match="malformed announcement: 'node_id'"):
        Announcement.from_json(body)


def test_malformed_txt_names_what_is_wrong() -> None:
    txt = announcement().to_txt()
    with pytest.raises(ValueError, match="malformed announcement: 'id'"):
        Announcement.from_txt({k: v for k, v in txt.items() if k != "id"})
    with pytest.raises(ValueError, match="device count"):
        Announcement.from_txt({**txt, "nd": "65"})
    with pytest.raises(ValueError, match="'d1'"):
        Announcement.from_txt({**txt, "nd": "2", "d1": None})  # type: ignore[dict-item]


def test_auth_cost_reports_each_step() -> None:
    cost = auth_cost(200)
    assert set(cost) == {"n", "sign_us", "verify_us", "txt_us", "receive_us"}
    assert cost["n"] == 200 and all(v > 0 for v in cost.values())
    with pytest.raises(ValueError):
        auth_cost(0)
