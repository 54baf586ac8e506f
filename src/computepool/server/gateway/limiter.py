"""Per-tenant rate limits of one gateway process: a token bucket per tenant.

The bucket fills at requests_per_minute / 60 a second up to `burst`; a request takes one token
or is refused with the seconds until one will be there. A tenant without a limit of its own
(`cpool tenants gateway-limit`) gets the default one (`--gateway-rpm`, `--gateway-burst`), so no
tenant's flood has the replicas to itself by default. Each gateway process keeps its own buckets:
with N gateways a tenant may get up to N times its rate (the docs say so).
"""

from __future__ import annotations

import math

from computepool.server.limits import TokenBuckets


class RateLimiter:
    def __init__(self, default: tuple[int, int] | None = None) -> None:
        """`default`: (requests per minute, burst) of tenants with no limit of their own; None (or
        a rate of 0): those are not limited."""
        self._default = default if default is not None and default[0] > 0 else None
        self._limits: dict[str, tuple[int, int]] = {}
        self._buckets = TokenBuckets()

    def set_limits(self, limits: dict[str, tuple[int, int]]) -> None:
        """tenant → (requests per minute, burst), as last read; tenants not listed get the default."""
        self._limits = dict(limits)
        if self._default is None:
            self._buckets.forget(set(self._limits))

    def take(self, tenant: str, now: float | None = None) -> int | None:
        """None when the request may go; else whole seconds (at least 1) to wait."""
        limit = self._limits.get(tenant, self._default)
        if limit is None:
            return None
        wait = self._buckets.take(tenant, limit[0] / 60.0, float(limit[1]), now)
        return None if wait is None else max(1, math.ceil(wait))
