"""The dashboard's session: the pool token in an HttpOnly cookie, its CSRF token beside it.

The cookie holds the token itself, so any replica accepts it and revoking the token ends the
session. Pages check the cookie here; the JSON API checks it in `deps.requires`, with the same
`auth.authenticate`, so roles and tenant rules are the API's.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs

from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool

from computepool.server.auth import CSRF_COOKIE, SESSION_COOKIE, authenticate, csrf_token
from computepool.server.errors import Unauthorized
from computepool.server.policy import HUMAN_ROLES, Principal

MAX_FORM_BYTES = 4096
# Pages load only this origin's script and style, may not be framed, and post forms only here.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'; object-src 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True)
class Session:
    bearer: str
    principal: Principal

    @property
    def csrf(self) -> str:
        return csrf_token(self.bearer)


class Refused(Exception):
    """A token that may not sign in; the message says why."""


async def check_token(request: Request, bearer: str) -> Session:
    """The session a pool token opens, or `Refused`: only people's tokens (not nodes', workers' or
    scrapers') sign in."""
    state = request.app.state
    try:
        principal = await run_in_threadpool(authenticate, state.db, bearer, state.caches.tokens)
    except Unauthorized as e:
        raise Refused(e.message) from e
    if principal.role not in HUMAN_ROLES:
        raise Refused(f"a {principal.role} token cannot sign in to the dashboard")
    return Session(bearer, principal)


async def current(request: Request) -> Session | None:
    """The signed-in session of this request, or None (no cookie, or its token no longer valid)."""
    bearer = request.cookies.get(SESSION_COOKIE)
    if not bearer:
        return None
    try:
        return await check_token(request, bearer)
    except Refused:
        return None


def open_session(response: Response, request: Request, session: Session) -> None:
    """Session cookies: Secure over HTTPS, SameSite=Strict, for the whole site, until the browser closes."""
    secure = request.url.scheme == "https"
    response.set_cookie(
        SESSION_COOKIE, session.bearer, path="/", httponly=True, samesite="strict", secure=secure
    )
    # readable by the page's script, which sends it back as X-CSRF-Token (the server recomputes it)
    response.set_cookie(CSRF_COOKIE, session.csrf, path="/", httponly=False, samesite="strict", secure=secure)


def close_session(response: Response) -> None:
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    response.delete_cookie(CSRF_COOKIE, path="/", samesite="strict")


def same_origin(request: Request) -> bool:
    """False when the browser says the form came from another site: the sign-in and sign-out forms,
    which no CSRF token can protect (there is no session yet, or it is ending)."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:  # the browser's own word (every current browser sends it)
        return site in ("same-origin", "none")
    origin = request.headers.get("origin")
    return origin is None or origin == f"{request.url.scheme}://{request.headers.get('host', '')}"


async def form(request: Request) -> dict[str, str]:
    """A small urlencoded form's fields (first value of each); anything larger or not text is empty."""
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        return {}
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        return {}
    try:
        return {k: v[0] for k, v in parse_qs(text, max_num_fields=8).items()}
    except ValueError:  # too many fields
        return {}
