"""Per-tenant rate limits of one gateway process: a token bucket per tenant.

The bucket fills at requests_per_minute / 60 a second up to `burst`; a request takes one token
or is refused with the seconds until one will be there. Each gateway process keeps its own
buckets: with N gateways a tenant may get up to N times its rate (the docs say so).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass
class _Bucket:
    rate: float  # tokens a second
    capacity: float
    tokens: float
    at: float


class RateLimiter:
    def __init__(self) -> None:
        self._limits: dict[str, tuple[int, int]] = {}
        self._buckets: dict[str, _Bucket] = {}

    def set_limits(self, limits: dict[str, tuple[int, int]]) -> None:
        """tenant → (requests per minute, burst), as last read; tenants not listed are not limited."""
        self._limits = dict(limits)
        for tenant in list(self._buckets):
            if tenant not in self._limits:
                del self._buckets[tenant]

    def take(self, tenant: str, now: float | None = None) -> int | None:
        """None when the request may go; else whole seconds (at least 1) to wait."""
        limit = self._limits.get(tenant)
        if limit is None:
            return None
        now = time.monotonic() if now is None else now
        rate, capacity = limit[0] / 60.0, float(limit[1])
        b = self._buckets.get(tenant)
        if b is None:
            b = self._buckets[tenant] = _Bucket(rate, capacity, capacity, now)
        elif (b.rate, b.capacity) != (rate, capacity):  # the limit changed: keep what is left
            b.rate, b.capacity, b.tokens = rate, capacity, min(b.tokens, capacity)
        b.tokens = min(b.capacity, b.tokens + (now - b.at) * b.rate)
        b.at = now
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return None
        return max(1, math.ceil((1.0 - b.tokens) / b.rate))
