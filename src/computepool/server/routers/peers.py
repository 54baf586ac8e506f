"""LAN discovery: the pool's discovery key for nodes, the peers each node reports, `cpool peers`."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Query

from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.logic import peers
from computepool.server.policy import Action
from computepool.wire.peers import DiscoveryKeyOut, NodePeersIn, PeersOut

router = APIRouter(tags=["peers"])


@router.get("/discovery/key", summary="The pool's LAN discovery key (node credential)")
def discovery_key(ctx: Annotated[Ctx, Depends(requires(Action.DISCOVERY_KEY_GET))]) -> DiscoveryKeyOut:
    return peers.discovery_key(ctx)


@router.put(
    "/nodes/{name}/peers",
    summary="A node replaces its report of the LAN peers its discovery found (its own credential)",
)
def report_peers(
    name: str,
    body: NodePeersIn,
    ctx: Annotated[Ctx, Depends(requires(Action.NODE_PEERS_REPORT))],
    sent_at: Annotated[
        datetime | None,
        Query(
            description="The node's clock when it sent the report: each last_seen is moved by the "
            "difference to the control plane's clock (a skewed node clock neither ages nor freshens a peer)."
        ),
    ] = None,
) -> PeersOut:
    return peers.report(ctx, name, body, sent_at)


@router.get("/peers", summary="The LAN peers the nodes found, verified or rejected (with the reason)")
def list_peers(
    ctx: Annotated[Ctx, Depends(requires(Action.PEER_LIST))],
    observer: Annotated[str | None, Query(max_length=63, description="Only what this node reported.")] = None,
) -> PeersOut:
    return peers.list_all(ctx, observer)
