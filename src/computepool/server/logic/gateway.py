"""Gateway usage (read) and per-tenant gateway rate limits (set by admins, read by the tenant)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from computepool.core.errors import InvalidInput
from computepool.core.quantities import parse_duration_s
from computepool.server.context import Ctx
from computepool.server.errors import Invalid, NotFound
from computepool.server.logic.audit import record
from computepool.server.logic.tenants import visible
from computepool.server.policy import authorize
from computepool.store import gateway as store
from computepool.store.db import db_now
from computepool.wire.common import Items
from computepool.wire.services import GatewayLimitIn, GatewayLimitOut, UsageRow

DEFAULT_SINCE = "7d"
USAGE_LIMIT = 10_000  # rows one listing returns unless asked for more
USAGE_LIMIT_MAX = 100_000


def parse_since(text: str | None, now: datetime) -> datetime:
    """`7d`, `12h` (that long ago) or an ISO 8601 time; whole hours, as usage is kept per hour."""
    raw = (text or DEFAULT_SINCE).strip()
    bad = f"since: expected an ISO 8601 time or a duration such as 7d or 12h, got {raw!r}"
    try:
        try:
            at = datetime.fromisoformat(raw)
            if at.tzinfo is None:
                at = at.replace(tzinfo=UTC)
        except ValueError:
            at = now - timedelta(seconds=parse_duration_s(raw, "since"))
        return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    except (InvalidInput, ValueError, OverflowError):  # not a time, or one outside the calendar
        raise Invalid(bad, "since") from None


def usage(
    ctx: Ctx, since: str | None, tenant: str | None, service: str | None, limit: int = USAGE_LIMIT
) -> Items[UsageRow]:
    scope = authorize(ctx.caller(), ctx.action)
    tenant, service = tenant or None, service or None  # an empty filter is no filter
    if scope.tenant is not None:
        if tenant is not None and tenant != scope.tenant:
            raise NotFound.of("tenant", tenant, "tenant")
        tenant = scope.tenant
    with ctx.db.read() as s:
        start = parse_since(since, db_now(s))
        rows = store.usage_rows(s, start, tenant, service, limit)
        items = [
            UsageRow(
                tenant=tname,
                user=u.user,
                token_id=u.token_id,
                service=u.service,
                hour=u.hour,
                requests=u.requests,
                failed=u.failed,
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
            )
            for u, tname in rows
        ]
    return Items[UsageRow](items=items)


def set_limit(ctx: Ctx, name: str, body: GatewayLimitIn) -> GatewayLimitOut:
    burst = body.burst if body.burst is not None else max(1, body.requests_per_minute // 6)
    with ctx.db.write() as s:
        tenant = visible(s, ctx, name)
        row = store.set_limit(s, tenant.id, body.requests_per_minute, burst)
        detail = {"requests_per_minute": row.requests_per_minute, "burst": row.burst}
        record(s, ctx, f"gateway-limit:{name}", tenant=name, detail=detail)
        return GatewayLimitOut(tenant=name, requests_per_minute=row.requests_per_minute, burst=row.burst)


def get_limit(ctx: Ctx, name: str) -> GatewayLimitOut:
    with ctx.db.read() as s:
        tenant = visible(s, ctx, name)
        row = store.get_limit(s, tenant.id)
        if row is None:
            raise NotFound(f"tenant '{name}' has no gateway limit")
        return GatewayLimitOut(tenant=name, requests_per_minute=row.requests_per_minute, burst=row.burst)


def delete_limit(ctx: Ctx, name: str) -> None:
    with ctx.db.write() as s:
        tenant = visible(s, ctx, name)
        if not store.delete_limit(s, tenant.id):
            raise NotFound(f"tenant '{name}' has no gateway limit")
        record(s, ctx, f"gateway-limit:{name}", tenant=name)
