"""Join tokens, node join and heartbeat, inventory, placement rules, cordon / uncordon / drain."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from computepool.server.context import Ctx
from computepool.server.deps import requires, unauthenticated
from computepool.server.logic import nodes
from computepool.server.policy import Action
from computepool.wire.common import Items
from computepool.wire.nodes import (
    Heartbeat,
    HeartbeatOut,
    JoinTokenCreate,
    JoinTokenCreated,
    NodeJoin,
    NodeJoined,
    NodeOut,
    NodePatch,
    NodeSettings,
)

router = APIRouter(tags=["nodes"])


@router.post("/join-tokens", status_code=201, summary="Create a join token for new nodes")
def create_join_token(
    body: JoinTokenCreate, ctx: Annotated[Ctx, Depends(requires(Action.JOIN_TOKEN_CREATE))]
) -> JoinTokenCreated:
    return nodes.create_join_token(ctx, body)


@router.post(
    "/nodes/join",
    status_code=201,
    summary="Join the pool (authenticated by the join token in the body)",
    responses={401: {"description": "Unknown, expired or used-up join token"}},
)
def join(
    body: NodeJoin, request: Request, ctx: Annotated[Ctx, Depends(unauthenticated(Action.NODE_JOIN))]
) -> NodeJoined:
    out = nodes.join(ctx, body, request.client.host if request.client else None)
    return out.model_copy(update={"servers": request.app.state.replicas.urls()})


@router.post("/nodes/{name}/heartbeat", summary="A node reports it is alive (node credential)")
def heartbeat(
    name: str,
    request: Request,
    ctx: Annotated[Ctx, Depends(requires(Action.NODE_HEARTBEAT))],
    body: Heartbeat | None = None,
) -> HeartbeatOut:
    peer = request.client.host if request.client else None
    out = nodes.heartbeat(ctx, name, body or Heartbeat(), peer)
    return out.model_copy(update={"servers": request.app.state.replicas.urls()})


@router.get("/nodes", summary="Nodes with their devices and state")
def list_nodes(ctx: Annotated[Ctx, Depends(requires(Action.NODE_LIST))]) -> Items[NodeOut]:
    return nodes.list_all(ctx)


@router.get("/nodes/{name}", summary="One node")
def get_node(name: str, ctx: Annotated[Ctx, Depends(requires(Action.NODE_LIST))]) -> NodeOut:
    return nodes.get(ctx, name)


@router.put("/nodes/{name}", summary="Replace a node's labels, taints and dedication")
def put_node(
    name: str, body: NodeSettings, ctx: Annotated[Ctx, Depends(requires(Action.NODE_UPDATE))]
) -> NodeOut:
    return nodes.update(ctx, name, body)


@router.patch("/nodes/{name}", summary="Change some of a node's labels, taints or dedication")
def patch_node(
    name: str, body: NodePatch, ctx: Annotated[Ctx, Depends(requires(Action.NODE_UPDATE))]
) -> NodeOut:
    return nodes.update(ctx, name, body)


@router.post("/nodes/{name}/cordon", summary="Place no new work on the node")
def cordon(name: str, ctx: Annotated[Ctx, Depends(requires(Action.NODE_CORDON))]) -> NodeOut:
    return nodes.set_flags(ctx, name, cordoned=True, draining=False)


@router.post("/nodes/{name}/uncordon", summary="Let work be placed on the node again")
def uncordon(name: str, ctx: Annotated[Ctx, Depends(requires(Action.NODE_UNCORDON))]) -> NodeOut:
    return nodes.set_flags(ctx, name, cordoned=False, draining=False)


@router.post("/nodes/{name}/drain", summary="Cordon the node and move its work away")
def drain(name: str, ctx: Annotated[Ctx, Depends(requires(Action.NODE_DRAIN))]) -> NodeOut:
    return nodes.set_flags(ctx, name, cordoned=True, draining=True)


@router.delete("/nodes/{name}", summary="Forget a node and its credentials")
def delete_node(name: str, ctx: Annotated[Ctx, Depends(requires(Action.NODE_DELETE))]) -> NodeOut:
    return nodes.delete(ctx, name)
