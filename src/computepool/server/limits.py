"""Request limits: the body cap, at the ASGI level (oversized bodies are refused before anything
parses them), the per-tenant API rate limit (a token bucket per tenant, checked once a caller is
known, so that one tenant's flood cannot starve the others' calls nor the agents'), and the rate
of failed authentications per client address (a flood of made-up tokens costs a database lookup
each: past the rate an address gets 429 before any lookup, while tokens already cached still pass)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import Message, Receive, Scope, Send

from computepool.server.errors import TooManyRequests, error_body
from computepool.server.policy import Principal, Role
from computepool.server.settings import ServerSettings

MAX_BUCKETS = 100_000  # past this many keys, full (idle) buckets are forgotten


async def capped_receive(scope: Scope, receive: Receive, limit: int) -> Receive | None:
    """`receive` for a body within `limit` bytes; None when it is larger (answer 413 unread).

    A declared Content-Length is judged from the header alone. A chunked body (no length) is read
    here, up to the limit, and replayed to the app: nothing oversized is ever parsed or kept whole.
    """
    length: bytes | None = None
    chunked = False
    for k, v in scope["headers"]:
        if k == b"content-length":
            length = v
        elif k == b"transfer-encoding":
            chunked = b"chunked" in v.lower()
    if length is not None:
        return receive if not length.strip().isdigit() or int(length) <= limit else None
    if not chunked:
        return receive
    held: list[Message] = []
    size = 0
    while True:
        message = await receive()
        held.append(message)
        if message["type"] != "http.request":
            break
        size += len(message.get("body", b""))
        if size > limit:
            return None
        if not message.get("more_body", False):
            break

    async def replay() -> Message:
        return held.pop(0) if held else await receive()

    return replay


async def too_large(send: Send, limit: int) -> None:
    body = json.dumps(
        error_body(f"request body too large: more than {limit} bytes (the server's --max-body-bytes)", "body")
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


@dataclass
class _Bucket:
    tokens: float
    at: float


class TokenBuckets:
    """A token bucket per key, kept by one process (N server replicas give a tenant up to N times
    its rate). A bucket fills at `rate` tokens a second up to `burst`; a request takes one token or
    is told the seconds until one is there. Used from the event loop only (no lock). `clock` is
    for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def take(self, key: str, rate: float, burst: float, now: float | None = None) -> float | None:
        """None when the request may go; else the seconds until a token will be there. A changed
        rate or burst keeps what was left, capped by the new burst."""
        now = self.clock() if now is None else now
        b = self._buckets.get(key)
        if b is None:
            if len(self._buckets) >= MAX_BUCKETS:
                self._forget_idle(now, rate, burst)
            b = self._buckets[key] = _Bucket(burst, now)
        b.tokens = min(burst, b.tokens + max(0.0, now - b.at) * rate)
        b.at = now
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return None
        return (1.0 - b.tokens) / rate

    def waiting(self, key: str, rate: float, burst: float, now: float | None = None) -> float | None:
        """Like `take` but takes nothing: None when a token is there, else the seconds until one is."""
        b = self._buckets.get(key)
        if b is None:
            return None
        now = self.clock() if now is None else now
        tokens = min(burst, b.tokens + max(0.0, now - b.at) * rate)
        return None if tokens >= 1.0 else (1.0 - tokens) / rate

    def forget(self, keep: set[str]) -> None:
        for key in [k for k in self._buckets if k not in keep]:
            del self._buckets[key]

    def _forget_idle(self, now: float, rate: float, burst: float) -> None:
        full = [k for k, b in self._buckets.items() if b.tokens + (now - b.at) * rate >= burst]
        for key in full:
            del self._buckets[key]


def api_rate_key(principal: Principal) -> str | None:
    """Whose bucket a call takes from: its tenant's (a tenant's function workers have one of their
    own beside it); none for nodes (agents are never starved by a tenant), admins and scrapers."""
    if principal.role in (Role.NODE, Role.ADMIN, Role.SCRAPER) or not principal.tenant:
        return None
    return f"{principal.tenant} workers" if principal.role is Role.WORKER else principal.tenant


def check_api_rate(buckets: TokenBuckets, settings: ServerSettings, principal: Principal) -> None:
    """Raise 429 (with Retry-After) when the caller's tenant is over `--api-rate`/`--api-burst`."""
    key = api_rate_key(principal)
    if key is None or settings.api_rate_per_s <= 0:
        return
    wait = buckets.take(key, settings.api_rate_per_s, float(settings.api_burst))
    if wait is not None:
        seconds = max(1, math.ceil(wait))
        raise TooManyRequests(
            f"tenant '{principal.tenant}' is over its API rate limit ({settings.api_rate_per_s:g} requests "
            f"a second, {settings.api_burst} at once); retry in {seconds} s",
            headers={"Retry-After": str(seconds)},
        )


def _auth_fail_key(client: str) -> str:
    return f"failed authentication from {client}"


def check_auth_failures(buckets: TokenBuckets, settings: ServerSettings, client: str | None) -> None:
    """Raise 429 (with Retry-After), before any token lookup, for an address past its rate of failed
    authentications (`--auth-fail-rate`, `--auth-fail-burst`)."""
    if not client or settings.auth_fail_rate_per_s <= 0:
        return
    wait = buckets.waiting(
        _auth_fail_key(client), settings.auth_fail_rate_per_s, float(settings.auth_fail_burst)
    )
    if wait is not None:
        seconds = max(1, math.ceil(wait))
        raise TooManyRequests(
            f"too many failed authentications from this address ({settings.auth_fail_rate_per_s:g} a "
            f"second, {settings.auth_fail_burst} at once); retry in {seconds} s",
            headers={"Retry-After": str(seconds)},
        )


def count_auth_failure(buckets: TokenBuckets, settings: ServerSettings, client: str | None) -> None:
    """One failed authentication from `client`, against its bucket."""
    if client and settings.auth_fail_rate_per_s > 0:
        buckets.take(_auth_fail_key(client), settings.auth_fail_rate_per_s, float(settings.auth_fail_burst))
