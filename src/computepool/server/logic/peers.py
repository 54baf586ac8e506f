"""LAN discovery on the control plane: the discovery key nodes sign with, each node's report of the
peers it found, and the merged list `cpool peers` shows.

The control plane never sees the LAN itself: it only keeps what each node's verified discovery
says, so a peer one node rejected and another trusts is visible as such.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from computepool.discovery.announce import derive_key, fingerprint
from computepool.server.context import Ctx
from computepool.server.errors import Forbidden, Invalid, NotFound
from computepool.server.keyfile import load_or_create_key
from computepool.server.policy import Target, authorize
from computepool.store import peers as sql
from computepool.store.db import db_now
from computepool.store.models import NodePeer
from computepool.wire.peers import (
    DiscoveryKeyOut,
    NodePeersIn,
    PeerDevice,
    PeerOut,
    PeersOut,
)


def discovery_key(ctx: Ctx) -> DiscoveryKeyOut:
    """The key a node signs and checks announcements with: derived from the server's secret, so
    the secret itself never leaves the control plane."""
    authorize(ctx.caller(), ctx.action)
    key = derive_key(load_or_create_key(ctx.settings.discovery_key_path, "discovery"))
    return DiscoveryKeyOut(key=key.hex(), fingerprint=fingerprint(key))


def report(ctx: Ctx, name: str, body: NodePeersIn, sent_at: datetime | None = None) -> PeersOut:
    """Replace what node `name` reports. Only that node's own credential may: any other name is
    answered like a missing node (a node learns nothing of the others' names this way). `sent_at`:
    the node's clock when it sent the report (a query parameter, which older servers ignore)."""
    try:
        authorize(ctx.caller(), ctx.action, Target("node", name, node=name))
    except Forbidden:
        raise NotFound.of("node", name) from None
    seen: dict[str, int] = {}
    for i, p in enumerate(body.peers):
        if p.peer_key in seen:
            raise Invalid(
                f"peers[{i}].peer_key: '{p.peer_key}' is reported twice (also peers[{seen[p.peer_key]}])",
                f"peers[{i}].peer_key",
            )
        seen[p.peer_key] = i
    rows = [
        sql.PeerRow(
            peer_key=p.peer_key,
            node_id=p.node_id,
            instance=p.instance,
            address=p.address,
            port=p.port,
            devices=[d.model_dump() for d in p.devices],
            status=p.status,
            reason=p.reason if p.status == "rejected" else "",
            source=p.source,
            rtt_ms=p.rtt_ms,
            bandwidth_mbps=p.bandwidth_mbps,
            last_seen=_utc(p.last_seen),
        )
        for p in body.peers
    ]
    with ctx.db.write() as s:
        now = db_now(s)
        shift = now - _utc(sent_at) if sent_at is not None else timedelta(0)
        # on the control plane's clock, and never in the future
        rows = [replace(r, last_seen=min(r.last_seen + shift, now)) for r in rows]
        sql.replace(s, name, rows, now)
        return PeersOut(items=[_out(r) for r in sql.list_all(s, observer=name)])


def list_all(ctx: Ctx, observer: str | None = None) -> PeersOut:
    authorize(ctx.caller(), ctx.action)
    with ctx.db.read() as s:
        return PeersOut(items=[_out(r) for r in sql.list_all(s, observer=observer)])


def _utc(t: datetime) -> datetime:
    """A report's time without a zone is taken as UTC (agents send UTC). It is the node's clock:
    `report` moves it to the control plane's by `sent_at`."""
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def _out(r: NodePeer) -> PeerOut:
    return PeerOut(
        observer=r.observer,
        peer_key=r.peer_key,
        node_id=r.node_id,
        instance=r.instance,
        address=r.address,
        port=r.port,
        devices=[PeerDevice.model_validate(d) for d in r.devices or []],
        status="ok" if r.status == "ok" else "rejected",
        reason=r.reason,
        source=r.source,
        rtt_ms=r.rtt_ms,
        bandwidth_mbps=r.bandwidth_mbps,
        last_seen=r.last_seen,
        reported_at=r.reported_at,
    )
