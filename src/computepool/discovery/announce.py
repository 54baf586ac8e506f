"""One node's signed announcement: what it says, how it is signed, and how a receiver checks it.

The key is the pool's discovery key (`derive_key` of the control plane's discovery secret; agents
fetch it with their node credential). An announcement proves its sender holds that key: a
receiver drops one whose HMAC-SHA256 does not match, one signed too long ago or in the future
(replays), and one from another pool (its `pool` fingerprint differs). `instance` is random per
agent start: two live instances announcing one `node_id` are a copied identity.

The same fields travel as mDNS TXT properties (each value at most 255 bytes) and as one JSON
datagram over unicast UDP; both are checked by `verify`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import math
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

VERSION = "1"
SERVICE_TYPE = "_computepool._tcp.local."
MAX_SKEW_S = 120.0  # an announcement signed longer ago (or further ahead) than this is a replay
KEY_CONTEXT = b"computepool discovery v1"
_DEVICE_RE = re.compile(r"^[A-Za-z0-9 _.:/()+-]{1,64}$")
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_DEVICES = 64


def derive_key(secret: bytes) -> bytes:
    """The discovery key nodes sign with, derived from the control plane's secret (never the secret
    itself, so a node's copy opens nothing else)."""
    return hmac.new(secret, KEY_CONTEXT, hashlib.sha256).digest()


def fingerprint(key: bytes) -> str:
    """A short, public name of the pool a key belongs to: announcements of other pools are told
    apart ("another pool") from forgeries ("bad signature") without revealing the key."""
    return hashlib.sha256(b"computepool pool id\0" + key).hexdigest()[:16]


def new_instance() -> str:
    return secrets.token_hex(8)


@dataclass(frozen=True)
class DeviceSummary:
    """What a peer offers, as it says: enough to plan with, checked again by the control plane."""

    index: int
    kind: str  # "gpu" | "cpu"
    model: str
    memory_mib: int

    def encode(self) -> str:
        return f"{self.index}:{self.kind}:{self.memory_mib}:{self.model}"

    @classmethod
    def decode(cls, text: str) -> DeviceSummary:
        index, kind, memory, model = text.split(":", 3)
        if kind not in ("gpu", "cpu") or not _DEVICE_RE.match(model):
            raise ValueError(f"bad device {text[:80]!r}")
        device = cls(int(index), kind, model, int(memory))
        if not (0 <= device.index <= 4096 and 0 <= device.memory_mib <= 1 << 40):
            raise ValueError(f"bad device {text[:80]!r}: index or memory out of range")
        return device


@dataclass(frozen=True)
class Announcement:
    pool: str  # fingerprint(key) of the sender's pool
    node_id: str  # the node's id in the pool (its registered name)
    instance: str  # random per agent start
    address: str  # where the sender's probe port answers (an IP)
    port: int  # its discovery/probe port (UDP and TCP)
    issued_at: float  # unix seconds, the sender's clock
    devices: tuple[DeviceSummary, ...] = ()
    signature: str = ""  # base64 HMAC-SHA256 over `signed_bytes()`
    version: str = VERSION

    def signed_bytes(self) -> bytes:
        body = asdict(self)
        body.pop("signature")
        body["devices"] = [d.encode() for d in self.devices]
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def signed(self, key: bytes) -> Announcement:
        mac = hmac.new(key, self.signed_bytes(), hashlib.sha256).digest()
        return _replace(self, signature=base64.b64encode(mac).decode())

    # -- wire forms ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, object]:
        body = asdict(self)
        body["devices"] = [d.encode() for d in self.devices]
        return body

    @classmethod
    def from_json(cls, body: Mapping[str, object]) -> Announcement:
        """Parse a datagram's JSON; ValueError names what is wrong (never trusted before `verify`)."""
        try:
            devices = tuple(DeviceSummary.decode(str(d)) for d in _seq(body.get("devices", ())))
            ann = cls(
                pool=str(body["pool"]),
                node_id=str(body["node_id"]),
                instance=str(body["instance"]),
                address=str(body["address"]),
                port=int(str(body["port"])),
                issued_at=float(str(body["issued_at"])),
                devices=devices,
                signature=str(body.get("signature", "")),
                version=str(body.get("version", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed announcement: {e}") from None
        return ann.checked()

    def to_txt(self) -> dict[str, str]:
        """mDNS TXT properties; devices as d0, d1, … (each value under 255 bytes)."""
        props = {
            "v": self.version,
            "pool": self.pool,
            "id": self.node_id,
            "inst": self.instance,
            "addr": self.address,
            "port": str(self.port),
            "at": repr(self.issued_at),
            "sig": self.signature,
            "nd": str(len(self.devices)),
        }
        for i, d in enumerate(self.devices):
            props[f"d{i}"] = d.encode()
        return props

    @classmethod
    def from_txt(
        cls, props: Mapping[bytes, bytes | None] | Mapping[str, str | None] | Mapping[str, str]
    ) -> Announcement:
        p = {_s(k): _s(v) for k, v in props.items() if v is not None}
        try:
            n = int(p.get("nd", "0"))
            if not 0 <= n <= MAX_DEVICES:
                raise ValueError(f"device count {n}")
            body: dict[str, object] = {
                "version": p.get("v", ""),
                "pool": p["pool"],
                "node_id": p["id"],
                "instance": p["inst"],
                "address": p["addr"],
                "port": p["port"],
                "issued_at": p["at"],
                "signature": p.get("sig", ""),
                "devices": [p[f"d{i}"] for i in range(n)],
            }
        except (KeyError, ValueError) as e:
            raise ValueError(f"malformed announcement: {e}") from None
        return cls.from_json(body)

    def checked(self) -> Announcement:
        """Shape checks before any trust: every field a receiver stores or shows is bounded, so a
        forged datagram cannot make a peer report (or a rejection reason) oversized."""
        if not _NAME_RE.match(self.node_id):
            raise ValueError(f"malformed announcement: node id {self.node_id[:64]!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"malformed announcement: port {self.port}")
        if not _TOKEN_RE.match(self.instance):
            raise ValueError(f"malformed announcement: instance {self.instance[:64]!r}")
        if not _TOKEN_RE.match(self.pool) or len(self.version) > 16:
            raise ValueError("malformed announcement: pool or version")
        try:
            ipaddress.ip_address(self.address)
        except ValueError:
            raise ValueError(f"malformed announcement: address {self.address[:64]!r} is not an IP") from None
        if "%" in self.address:  # a scope is free text: it could smuggle a comma into an endpoint list
            raise ValueError(f"malformed announcement: address {self.address[:64]!r} has a scope")
        if not math.isfinite(self.issued_at):
            raise ValueError("malformed announcement: issued_at is not a finite time")
        if len(self.devices) > MAX_DEVICES:
            raise ValueError(f"malformed announcement: over {MAX_DEVICES} devices")
        return self


def verify(ann: Announcement, key: bytes, now: float, max_skew_s: float = MAX_SKEW_S) -> str | None:
    """None when `ann` is genuine and fresh; else the reason it is rejected, in words `cpool peers`
    shows."""
    if ann.version != VERSION:
        return f"unsupported announcement version {ann.version!r}"
    if not ann.signature:
        return "unsigned announcement"
    if ann.pool != fingerprint(key):
        # Still a bad signature as far as this pool is concerned (a node given the wrong key shows
        # up here); the fingerprint tells an operator it is a different pool, not a forgery.
        return f"bad signature: signed with another pool's key (fingerprint {ann.pool})"
    expected = hmac.new(key, ann.signed_bytes(), hashlib.sha256).digest()
    try:
        given = base64.b64decode(ann.signature, validate=True)
    except ValueError:
        return "bad signature (not base64)"
    if not hmac.compare_digest(expected, given):
        return "bad signature: not signed with this pool's discovery key"
    skew = now - ann.issued_at
    if skew > max_skew_s:
        return f"stale announcement (signed {skew:.0f} s ago; a replay?)"
    if skew < -max_skew_s:
        return f"announcement from the future ({-skew:.0f} s ahead; clocks apart?)"
    return None


def _replace(ann: Announcement, **changes: object) -> Announcement:
    from dataclasses import replace

    return replace(ann, **changes)  # type: ignore[arg-type]


def _seq(value: object) -> Sequence[object]:
    if isinstance(value, (list, tuple)):
        return value
    raise ValueError("devices must be a list")


def _s(v: bytes | str) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


__all__ = [
    "MAX_SKEW_S",
    "SERVICE_TYPE",
    "Announcement",
    "DeviceSummary",
    "derive_key",
    "fingerprint",
    "new_instance",
    "verify",
]
