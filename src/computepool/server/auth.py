"""Authentication: a bearer token → a Principal, or 401. Authorization is in `policy`.

A token found valid is remembered for a second (`caches.TokenCache`), so most calls cost one
SHA-256 and no query; the secret is checked against the stored hash every time.

The dashboard sends the same token in its session cookie; a write made with that cookie must also
carry the session's CSRF token (`check_csrf`), which a page of another site cannot know.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import UTC, datetime

from sqlalchemy.orm import Session

from computepool.core.allocation import HOLDING
from computepool.server.caches import TokenCache
from computepool.server.credentials import hash_secret, secret_matches, split_token
from computepool.server.errors import Forbidden, Unauthorized
from computepool.server.policy import Principal, Role
from computepool.store import functions, tokens
from computepool.store.db import Database, db_now

SESSION_COOKIE = "cpool_session"  # the dashboard's pool token (HttpOnly)
CSRF_COOKIE = "cpool_csrf"  # its CSRF token, readable by the dashboard's script
CSRF_HEADER = "X-CSRF-Token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def csrf_token(bearer: str) -> str:
    """The CSRF token of a dashboard session, derived from its pool token.

    Derived rather than stored, so every replica computes the same one with no shared state; one
    who cannot read the token (another site's page) cannot make it, and it does not reveal the token.
    """
    return hmac.new(bearer.encode(), b"computepool dashboard csrf", hashlib.sha256).hexdigest()


def check_csrf(bearer: str, given: str | None) -> None:
    """A write sent with the session cookie must carry the session's CSRF token, else 403."""
    if not given or not hmac.compare_digest(given.encode(), csrf_token(bearer).encode()):
        raise Forbidden(f"missing or wrong CSRF token (send header {CSRF_HEADER} with writes)")


def authenticate(db: Database, bearer: str | None, cache: TokenCache | None = None) -> Principal:
    if not bearer:
        raise Unauthorized("missing bearer token (send 'Authorization: Bearer <id>.<secret>')")
    parts = split_token(bearer)
    if parts is None:
        raise Unauthorized("malformed token (expected '<id>.<secret>')")
    token_id, secret = parts
    if cache is not None:
        hit = cache.get(token_id)
        if hit is not None and (hit.expires_at is None or hit.expires_at > datetime.now(UTC)):
            if not secret_matches(secret, hit.secret_hash):
                raise Unauthorized("invalid token")
            return hit.principal
    with db.read() as s:
        tok = tokens.get(s, token_id)
        if tok is None:  # not a user's or node's token: perhaps a function worker's
            worker = _worker(s, token_id, secret)
            if cache is not None:
                cache.put(token_id, hash_secret(secret), worker, None)
            return worker
        if not secret_matches(secret, tok.secret_hash):
            raise Unauthorized("invalid token")
        if tok.revoked_at is not None:
            raise Unauthorized(f"token {token_id} was revoked")
        if tok.expires_at is not None and tok.expires_at <= db_now(s):
            raise Unauthorized(f"token {token_id} has expired")
        if tok.node is not None:
            principal = Principal(
                name=tok.node.name, role=Role.NODE, tenant=None, token_id=tok.id, node=tok.node.name
            )
        elif tok.user is None:
            raise Unauthorized("invalid token")
        else:
            principal = Principal(
                name=tok.user.name, role=Role(tok.user.role), tenant=tok.user.tenant.name, token_id=tok.id
            )
        if cache is not None:
            cache.put(token_id, hash_secret(secret), principal, tok.expires_at)
        return principal


def _worker(s: Session, token_id: str, secret: str) -> Principal:
    """A function worker's principal, while its worker allocation holds (bound or active)."""
    w = functions.worker_by_token(s, token_id)
    if w is None or not secret_matches(secret, w.secret_hash):
        raise Unauthorized("invalid token")
    if w.state not in HOLDING:
        raise Unauthorized(f"worker token of allocation {w.allocation_id} is no longer valid ({w.state})")
    return Principal(
        name=f"worker-{w.allocation_id}",
        role=Role.WORKER,
        tenant=w.tenant,
        token_id=token_id,
        worker=w.allocation_id,
        function=w.function_id,
    )
