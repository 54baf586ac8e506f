"""LAN discovery's wire types: what an agent reports of the peers it found, what `cpool peers`
lists, and the discovery key a node fetches (one definition for server, agent and client)."""

from __future__ import annotations

import ipaddress
from datetime import datetime
from typing import Literal

from pydantic import Field, field_validator

from computepool.wire.common import In, Items, Name, Out

PeerStatus = Literal["ok", "rejected"]
PeerSource = Literal["mdns", "unicast"]
MAX_PEERS_PER_REPORT = 256


class PeerDevice(In):
    """A device as the peer announced it (kind "gpu" or "cpu")."""

    index: int = Field(strict=True, ge=0, le=4096)
    kind: Literal["gpu", "cpu"]
    model: str = Field(max_length=64)
    memory_mib: int = Field(strict=True, ge=0, le=1 << 40)


class PeerReport(In):
    """One peer as the reporting node's discovery last saw it."""

    peer_key: str = Field(min_length=1, max_length=160, description="Its node id, or ADDRESS:PORT.")
    node_id: Name | None = None
    instance: str = Field(default="", max_length=64)
    address: str = Field(
        default="", max_length=253, description="An IP address; empty when a rejected sender had none."
    )
    port: int | None = Field(default=None, strict=True, ge=1, le=65535)
    devices: list[PeerDevice] = Field(default_factory=list, max_length=64)
    status: PeerStatus
    reason: str = Field(default="", max_length=512, description="Why it was rejected; empty when ok.")
    source: PeerSource
    rtt_ms: float | None = Field(default=None, ge=0, le=3_600_000)
    bandwidth_mbps: float | None = Field(default=None, ge=0, le=10_000_000)
    last_seen: datetime

    @field_validator("address")
    @classmethod
    def _an_ip(cls, value: str) -> str:
        """It may end up in an RPC endpoint list: a name, a port, a comma (an IPv6 scope may hold
        one) in it must not."""
        if value:
            try:
                ipaddress.ip_address(value)
                if "%" in value:
                    raise ValueError
            except ValueError:
                raise ValueError("must be an IP address (without an IPv6 scope)") from None
        return value


class NodePeersIn(In):
    """PUT /nodes/{name}/peers: the reporting node's whole current view (replaces the last one)."""

    peers: list[PeerReport] = Field(default_factory=list, max_length=MAX_PEERS_PER_REPORT)


class PeerOut(Out):
    observer: str = Field(description="The node whose discovery found it.")
    peer_key: str
    node_id: str | None
    instance: str
    address: str
    port: int | None
    devices: list[PeerDevice]
    status: PeerStatus
    reason: str
    source: str
    rtt_ms: float | None
    bandwidth_mbps: float | None
    last_seen: datetime
    reported_at: datetime


class PeersOut(Items[PeerOut]):
    pass


class DiscoveryKeyOut(Out):
    key: str = Field(description="The pool's discovery key, hex (a node's secret: never logged).")
    fingerprint: str = Field(description="The pool's public fingerprint announcements carry.")
