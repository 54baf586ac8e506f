"""FastAPI dependencies: how a route declares its action, and gets an authenticated `Ctx`.

    @router.post("/things")
    def create(body: ThingIn, ctx: Annotated[Ctx, Depends(requires(Action.THING_CREATE))]) -> ThingOut:
        return things.create(ctx, body)

`requires` authenticates the bearer token (or, without one, the dashboard's session cookie, whose
writes must carry the CSRF token), checks the role may do the action at all, and marks the
route; a test walks `app.routes` and fails on any /api/v1 route without such a mark.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated

from fastapi import Depends, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from computepool.server.auth import CSRF_HEADER, SAFE_METHODS, SESSION_COOKIE, authenticate, check_csrf
from computepool.server.caches import TokenCache
from computepool.server.context import Ctx
from computepool.server.credentials import secret_matches, split_token
from computepool.server.errors import ApiError, NotFound, Unauthorized
from computepool.server.limits import check_api_rate, check_auth_failures, count_auth_failure
from computepool.server.policy import HUMAN_ROLES, Action, Principal, authorize
from computepool.wire.common import MAX_ID

ACTION_ATTR = "__cpool_action__"
# Integer ids in paths, by parameter name: the kind of object they name, for the 404.
ID_PARAMS = {"alloc_id": "allocation", "fid": "function", "cid": "call"}
_INTEGER = re.compile(r"^-?[0-9]+$")
_bearer = HTTPBearer(auto_error=False, description="An API token `<id>.<secret>`.")
# on answers to the dashboard's cookie-borne calls: a tenant's data is not kept in shared or disk
# caches, nor read by the browser as anything but what it is declared
SESSION_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


def _ctx(request: Request, action: Action) -> Ctx:
    return Ctx(
        db=request.app.state.db,
        settings=request.app.state.settings,
        action=action,
        request_id=request.state.request_id,
        principal=getattr(request.state, "principal", None),
        caches=request.app.state.caches,
    )


def _cached(cache: TokenCache, bearer: str | None) -> Principal | None:
    """A principal straight from the cache, on the event loop (no thread hop); None to ask the DB."""
    if not bearer:
        return None
    parts = split_token(bearer)
    if parts is None:
        return None
    hit = cache.get(parts[0])
    if hit is None or (hit.expires_at is not None and hit.expires_at <= datetime.now(UTC)):
        return None
    return hit.principal if secret_matches(parts[1], hit.secret_hash) else None


def _check_ids(request: Request) -> None:
    """An integer id no database column can hold names nothing: the same 404 as a missing object.

    Checked here, once for every route, after authentication (an anonymous caller still gets 401),
    rather than letting SQLite fail on the number (OverflowError) route by route.
    """
    for param, kind in ID_PARAMS.items():
        raw = request.path_params.get(param)
        if not isinstance(raw, str) or not _INTEGER.match(raw):
            continue  # not a number at all: the route's validation answers 422
        if len(raw) > 40:  # beyond any id (and Python's int() digit limit): named as given
            raise NotFound.of(kind, raw)
        if not 1 <= int(raw) <= MAX_ID:
            raise NotFound.of(kind, int(raw))


def requires(action: Action) -> Callable[..., object]:
    """A dependency that authenticates the caller and declares `action` for the route."""

    async def dependency(
        request: Request,
        response: Response,
        creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> Ctx:
        request.state.action = action
        if creds is None and SESSION_COOKIE in request.cookies:
            response.headers.update(SESSION_HEADERS)
            try:
                return await _admit(request, action, request.cookies[SESSION_COOKIE], session=True)
            except ApiError as e:
                e.headers = {**e.headers, **SESSION_HEADERS}
                raise
        return await _admit(request, action, creds.credentials if creds else None, session=False)

    setattr(dependency, ACTION_ATTR, action)
    return dependency


async def _admit(request: Request, action: Action, bearer: str | None, session: bool) -> Ctx:
    """Authenticate `bearer` (the session cookie's token when `session`), check the role may do
    `action`, and give the route its `Ctx`."""
    caches = request.app.state.caches
    hit = _cached(caches.tokens, bearer)
    if hit is not None:
        principal = hit
    else:
        limits, settings = request.app.state.api_limits, request.app.state.settings
        client = request.client.host if request.client and bearer else None  # no token: no lookup
        check_auth_failures(limits, settings, client)
        try:
            principal = await run_in_threadpool(authenticate, request.app.state.db, bearer, caches.tokens)
        except Unauthorized:
            count_auth_failure(limits, settings, client)
            raise
    request.state.principal = principal
    check_api_rate(request.app.state.api_limits, request.app.state.settings, principal)
    if session and bearer:
        if principal.role not in HUMAN_ROLES:
            raise Unauthorized(f"a {principal.role} token cannot be used as a dashboard session")
        if request.method not in SAFE_METHODS:
            check_csrf(bearer, request.headers.get(CSRF_HEADER))
    authorize(principal, action)
    _check_ids(request)
    return _ctx(request, action)


def unauthenticated(action: Action) -> Callable[..., object]:
    """For the one route that carries its own credential in the body (node.join)."""

    async def dependency(request: Request) -> Ctx:
        request.state.action = action
        return _ctx(request, action)

    setattr(dependency, ACTION_ATTR, action)
    return dependency
