"""The OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions, /v1/embeddings.

Callers authenticate with pool tokens exactly as on /api/v1 (the same token check and the same
`authorize`); errors answer in OpenAI's shape, `{"error": {"message", "type", "code"}}`, which
OpenAI client libraries show. The body is passed to a replica untouched.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.types import Receive, Scope, Send

from computepool.server.auth import authenticate
from computepool.server.deps import _cached
from computepool.server.errors import ApiError
from computepool.server.gateway.core import Caller, Gateway, GatewayError
from computepool.server.policy import Action, Principal, authorize

router = APIRouter(tags=["gateway"])

MAX_BODY_BYTES = 1 << 20  # `cpool gateway`'s default; `cpool server` uses its --max-body-bytes
_KINDS = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error"}
_CODES = {401: "invalid_api_key", 403: "permission_denied", 404: "not_found"}


# A replica's answer is a tenant's bytes served from the pool's own origin (the dashboard's): never
# sniffed into another type, and never run as a page, whatever content type the replica claims.
REPLICA_ANSWER_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "sandbox; default-src 'none'",
}


def error_response(
    status: int, message: str, kind: str, code: str | None, headers: dict[str, str]
) -> JSONResponse:
    safe = message.encode("utf-8", "backslashreplace").decode("utf-8")  # lone surrogates escaped
    body = {"error": {"message": safe, "type": kind, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _gateway_error(e: GatewayError) -> JSONResponse:
    return error_response(e.status, e.message, e.kind, e.code, e.headers)


class GuardedStream(StreamingResponse):
    """A streamed answer whose cleanup runs however the response ends, even when its body never
    starts (the caller gone first), which would leave the relay's own `finally` unrun."""

    def __init__(
        self, content: AsyncIterator[bytes], close: Callable[[], Awaitable[None]] | None, **kw: Any
    ) -> None:
        super().__init__(content, **kw)
        self._close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._close is not None:
                await self._close()


async def _principal(request: Request, action: Action) -> Principal:
    gw: Gateway = request.app.state.gateway
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    bearer = credentials.strip() if scheme.lower() == "bearer" and credentials.strip() else None
    try:
        principal = _cached(gw.tokens, bearer)
        if principal is None:
            principal = await run_in_threadpool(authenticate, gw.db, bearer, gw.tokens)
        authorize(principal, action)
    except ApiError as e:
        raise GatewayError(
            e.status,
            e.message,
            _KINDS.get(e.status, "invalid_request_error"),
            _CODES.get(e.status),
            **e.headers,
        ) from None
    except (OperationalError, InterfaceError, PoolTimeout):
        raise GatewayError(
            503, "database unavailable, retry later", "server_error", "unavailable", **{"Retry-After": "2"}
        ) from None
    return principal


@router.get("/v1/models", summary="The models (services) this token may use")
async def models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        principal = await _principal(request, Action.GATEWAY_MODELS_LIST)
    except GatewayError as e:
        return _gateway_error(e)
    data = [
        {"id": gw.model_id(principal, i), "object": "model", "created": i.created, "owned_by": i.tenant}
        for i in await gw.visible(principal)
    ]
    return JSONResponse({"object": "list", "data": data})


def body_limit(request: Request) -> int:
    """One limit on request bodies for both servers: `cpool server`'s --max-body-bytes (whose
    middleware answers first), or the gateway app's own."""
    state = request.app.state
    own: int | None = getattr(state, "max_body_bytes", None)
    if own is None:
        own = getattr(getattr(state, "settings", None), "max_body_bytes", MAX_BODY_BYTES)
    return int(own or MAX_BODY_BYTES)


async def _read_body(request: Request) -> bytes:
    """The body, read as it comes and refused as soon as it passes the limit (chunked ones too)."""
    limit = body_limit(request)
    too_large = GatewayError(
        413, f"body: larger than {limit} bytes", "invalid_request_error", "request_too_large"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise too_large
    return bytes(raw)


async def _read_json(request: Request) -> tuple[bytes, dict[str, Any]]:
    raw = await _read_body(request)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON (nor UTF-8), or nested too deep to parse
        raise GatewayError(400, "body: not valid JSON", "invalid_request_error", "invalid_json") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "body: a JSON object is required", "invalid_request_error")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise GatewayError(
            400, "model: required (the service's name)", "invalid_request_error", "missing_model"
        )
    return raw, body


async def _infer(request: Request, path: str) -> Response:
    gw: Gateway = request.app.state.gateway
    try:
        principal = await _principal(request, Action.GATEWAY_USE)
        raw, body = await _read_json(request)
        info = await gw.find(principal, body["model"])
        gw.admit(info)
        # usage counts against the service's tenant (an admin may call any tenant's service)
        caller = Caller(info.tenant_id, principal.name, principal.token_id, info)
        content_type = request.headers.get("content-type") or "application/json"
        answer = await gw.forward(caller, path, raw, content_type, streaming=body.get("stream") is True)
    except GatewayError as e:
        return _gateway_error(e)
    if answer.stream is not None:
        return GuardedStream(
            answer.stream,
            answer.close,
            status_code=answer.status,
            media_type=answer.content_type,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **REPLICA_ANSWER_HEADERS},
        )
    return Response(
        answer.body, status_code=answer.status, media_type=answer.content_type, headers=REPLICA_ANSWER_HEADERS
    )


@router.post("/v1/chat/completions", summary="Chat completion by a service's replica (OpenAI API)")
async def chat_completions(request: Request) -> Response:
    return await _infer(request, "/v1/chat/completions")


@router.post("/v1/completions", summary="Text completion by a service's replica (OpenAI API)")
async def completions(request: Request) -> Response:
    return await _infer(request, "/v1/completions")


@router.post("/v1/embeddings", summary="Embeddings by a service's replica (OpenAI API)")
async def embeddings(request: Request) -> Response:
    return await _infer(request, "/v1/embeddings")
