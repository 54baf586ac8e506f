"""Authentication: a bearer token → a Principal, or 401. Authorization is in `policy`."""

from __future__ import annotations

from computepool.server.credentials import secret_matches, split_token
from computepool.server.errors import Unauthorized
from computepool.server.policy import Principal, Role
from computepool.store import tokens
from computepool.store.db import Database, db_now


def authenticate(db: Database, bearer: str | None) -> Principal:
    if not bearer:
        raise Unauthorized("missing bearer token (send 'Authorization: Bearer <id>.<secret>')")
    parts = split_token(bearer)
    if parts is None:
        raise Unauthorized("malformed token (expected '<id>.<secret>')")
    token_id, secret = parts
    with db.read() as s:
        tok = tokens.get(s, token_id)
        if tok is None or not secret_matches(secret, tok.secret_hash):
            raise Unauthorized("invalid token")
        if tok.revoked_at is not None:
            raise Unauthorized(f"token {token_id} was revoked")
        if tok.expires_at is not None and tok.expires_at <= db_now(s):
            raise Unauthorized(f"token {token_id} has expired")
        if tok.node is not None:
            return Principal(
                name=tok.node.name, role=Role.NODE, tenant=None, token_id=tok.id, node=tok.node.name
            )
        if tok.user is None:
            raise Unauthorized("invalid token")
        return Principal(
            name=tok.user.name, role=Role(tok.user.role), tenant=tok.user.tenant.name, token_id=tok.id
        )
