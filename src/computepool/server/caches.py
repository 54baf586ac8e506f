"""Short-lived, per-process caches for the hot path: authenticated tokens and the pool's shape.

Both hold what changes rarely but is read on every call. They are hints with a bounded age,
never the authority: a cached token stays valid for at most `ttl_s` after another replica
revokes it (this process forgets it at once), and a cached shape is only trusted to *accept*
a request — a refusal (422: can never fit, exceeds the tenant's limit) is re-checked against
the database before it is answered. (A shape older than a change made on another replica may
accept a request that can no longer fit: it waits `pending`, and `explain` says why.)
They live on `app.state.caches`, not in module globals.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from computepool.server.policy import Principal

TOKEN_TTL_S = 1.0
NODE_TOKEN_TTL_S = 30.0  # a node credential dies with its node: a stale hit still finds no node
SHAPE_TTL_S = 10.0
MAX_FIT_ENTRIES = 4096


@dataclass(frozen=True)
class TokenEntry:
    secret_hash: str
    principal: Principal
    expires_at: datetime | None
    until: float  # time.monotonic() after which the database is asked again


class TokenCache:
    """token id → what authentication found for it, for `ttl_s` seconds (`node_ttl_s` for the
    credentials of nodes, which heartbeat every few seconds and are only ever revoked by
    deleting their node: every node route then answers 404 whatever the cache says).
    `now` is its clock (tests move one by hand, as they do the rate limits')."""

    def __init__(
        self,
        ttl_s: float = TOKEN_TTL_S,
        node_ttl_s: float = NODE_TOKEN_TTL_S,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.now = now
        self.node_ttl_s = node_ttl_s if ttl_s > 0 else 0.0
        self._entries: dict[str, TokenEntry] = {}
        self._lock = threading.Lock()

    def get(self, token_id: str) -> TokenEntry | None:
        e = self._entries.get(token_id)
        if e is None or e.until < self.now():
            return None
        return e

    def put(self, token_id: str, secret_hash: str, principal: Principal, expires_at: datetime | None) -> None:
        ttl = self.node_ttl_s if principal.node is not None else self.ttl_s
        if ttl <= 0:
            return
        with self._lock:
            if len(self._entries) > 10_000:  # many distinct tokens (agents): drop the stale ones
                now = self.now()
                self._entries = {k: v for k, v in self._entries.items() if v.until >= now}
            # spread the expiries: a thousand agents that joined together must not all miss at once
            until = self.now() + ttl * (0.5 + random.random() / 2)
            self._entries[token_id] = TokenEntry(secret_hash, principal, expires_at, until)

    def forget(self, token_id: str | None = None) -> None:
        """Drop one token (revoked here), or all of them (credentials deleted with a node)."""
        with self._lock:
            if token_id is None:
                self._entries.clear()
            else:
                self._entries.pop(token_id, None)


@dataclass
class Shape:
    """What `POST /allocations` checks a request against: capacities and quotas, not usage."""

    snapshot: Any  # scheduling.Snapshot without live allocations
    tenant_ids: dict[str, int]
    until: float
    fits: dict[tuple[Any, ...], str | None]  # request key → why it never fits (None: it can)
    defaults: dict[str, Any]  # tenant → what its requests get when they name no CPU or memory


class ShapeCache:
    """The pool's nodes, tenants (with their request defaults) and quotas as last read, refreshed
    after `ttl_s` or a change here."""

    def __init__(self, ttl_s: float = SHAPE_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._shape: Shape | None = None
        self._lock = threading.Lock()

    def get(self, load: Callable[[], tuple[Any, dict[str, int], dict[str, Any]]]) -> Shape:
        shape = self._shape
        if shape is not None and shape.until >= time.monotonic():
            return shape
        snap, tenant_ids, defaults = load()
        shape = Shape(snap, tenant_ids, time.monotonic() + self.ttl_s, {}, defaults)
        with self._lock:
            self._shape = shape
        return shape

    def invalidate(self) -> None:
        """Something this process changed (a node joined or left, a quota) must be seen at once."""
        with self._lock:
            self._shape = None

    @staticmethod
    def remember_fit(shape: Shape, key: tuple[Any, ...], why: str | None) -> None:
        if len(shape.fits) >= MAX_FIT_ENTRIES:
            shape.fits.clear()
        shape.fits[key] = why


@dataclass
class Caches:
    tokens: TokenCache
    shape: ShapeCache

    @classmethod
    def create(cls, token_ttl_s: float = TOKEN_TTL_S, shape_ttl_s: float = SHAPE_TTL_S) -> Caches:
        return cls(TokenCache(token_ttl_s), ShapeCache(shape_ttl_s))
