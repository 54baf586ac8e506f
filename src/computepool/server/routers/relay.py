"""Relay sessions: the user's ask (POST), the agent's long-poll, and the WebSocket both sides open.

The WebSocket route is mounted apart (`ws_router`): it authenticates the bearer token itself (a
socket has no FastAPI dependencies' error answers) and answers a refusal as one {"error"} frame
and a close code of 4000 + the HTTP status it would have had.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import MutableMapping
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, WebSocket
from fastapi.concurrency import run_in_threadpool
from starlette.websockets import WebSocketDisconnect

from computepool.server.auth import authenticate
from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.errors import ApiError, Invalid, Unauthorized
from computepool.server.hub import Hub
from computepool.server.limits import check_api_rate, check_auth_failures, count_auth_failure
from computepool.server.logic import relay
from computepool.server.policy import Action
from computepool.server.routers.allocations import MAX_WAIT_S, get_hub
from computepool.server.routers.polling import long_poll
from computepool.wire.relay import CLIENT_SECRET_HEADER, PendingRelays, RelayCreate, RelayOut

router = APIRouter(tags=["relay"])
ws_router = APIRouter()


@router.post(
    "/allocations/{alloc_id}/relays",
    status_code=201,
    summary="Open a shell in a running job or a connection to its port (then connect to the socket)",
)
def create_relay(
    alloc_id: int,
    body: RelayCreate,
    request: Request,
    ctx: Annotated[Ctx, Depends(requires(Action.ALLOCATION_EXEC))],
    hub: Annotated[Hub, Depends(get_hub)],
) -> RelayOut:
    replicas = request.app.state.replicas
    # with one replica every client's own URL reaches it (a proxy's name, say, not the bound address)
    here = replicas.url if len(replicas.urls()) > 1 else None
    return relay.create(ctx, alloc_id, body, hub, here)


@router.get("/nodes/{name}/relays", summary="Sessions this node's agent should dial back to (long-poll)")
async def node_relays(
    name: str,
    ctx: Annotated[Ctx, Depends(requires(Action.NODE_RELAYS))],
    hub: Annotated[Hub, Depends(get_hub)],
    wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, description="Seconds to wait for one.")] = 0,
    since: Annotated[int, Query(ge=0, lt=2**63, description="The highest session id seen.")] = 0,
) -> PendingRelays:
    return await long_poll(
        hub, relay.topic(name), wait, lambda: relay.pending_for(ctx, name, since), lambda out: bool(out.items)
    )


@ws_router.websocket("/relays/{sid}/{side}")
async def relay_socket(websocket: WebSocket, sid: int, side: str) -> None:
    """One side ("client": the user; "node": the job's agent) of session `sid`."""
    state = websocket.app.state
    await websocket.accept()
    try:
        if side not in ("client", "node"):
            raise Invalid(f"side: {side!r} is neither 'client' nor 'node'", "side")
        auth = websocket.headers.get("authorization", "")
        bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        client = websocket.client.host if websocket.client and bearer else None
        check_auth_failures(state.api_limits, state.settings, client)  # as every route's (deps.py)
        try:
            principal = await run_in_threadpool(authenticate, state.db, bearer, state.caches.tokens)
        except Unauthorized:
            count_auth_failure(state.api_limits, state.settings, client)
            raise
        check_api_rate(state.api_limits, state.settings, principal)
        relay.authenticate_socket(principal)
        secret = websocket.headers.get(CLIENT_SECRET_HEADER, "")
        await run_in_threadpool(relay.claim, state.db, principal, sid, secret, side)
    except ApiError as e:
        with contextlib.suppress(Exception):
            await websocket.send_text(json.dumps({"error": e.message, "status": e.status}))
            await websocket.close(code=4000 + e.status)
        return
    meetings: relay.Meetings = state.relay_meetings
    try:
        other = await meetings.meet(sid, side, websocket, relay.SESSION_TTL.total_seconds())
        if other is None:
            who = "the job's node did not answer" if side == "client" else "the user did not connect"
            wait = int(relay.SESSION_TTL.total_seconds())
            with contextlib.suppress(Exception):
                await websocket.send_text(json.dumps({"error": f"{who} within {wait} s", "status": 504}))
            return
        if side == "node":
            await meetings.hold(sid)
            return
        await _relay(websocket, other)
    finally:
        meetings.finish(sid)
        with contextlib.suppress(Exception):
            await websocket.close()
        await run_in_threadpool(relay.end, state.db, sid)


async def _relay(client: WebSocket, node: WebSocket) -> None:
    """Frames both ways until either side closes."""

    async def pump(src: WebSocket, dst: WebSocket) -> None:
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            while True:
                msg: MutableMapping[str, Any] = await src.receive()
                if msg["type"] == "websocket.disconnect":
                    return
                if msg.get("bytes") is not None:
                    await dst.send_bytes(msg["bytes"])
                elif msg.get("text") is not None:
                    await dst.send_text(msg["text"])

    tasks = [asyncio.create_task(pump(client, node)), asyncio.create_task(pump(node, client))]
    try:
        _done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        # the job's side ended: what it sent is through; the user's side ended: stop the job's side
        for t in pending:
            t.cancel()
    finally:
        for t in tasks:
            t.cancel()
        for ws in (client, node):
            with contextlib.suppress(Exception):
                await ws.close()
