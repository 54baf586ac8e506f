"""Reading the usage ledger (grouped, priced), prices, device history, and the static equivalent.

Every reader is scoped by `authorize`: a non-admin sees its own tenant's rows only, and the
pool's own row (energy of devices that held nothing) is an admin's alone.
"""

from __future__ import annotations

import difflib
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from computepool.core.errors import InvalidInput
from computepool.core.quantities import parse_duration_s
from computepool.core.usage import ENERGY_ITEM, POOL_TENANT, UsageBy
from computepool.server.context import Ctx
from computepool.server.errors import Invalid, NotFound
from computepool.server.ledger import static_equivalent as se
from computepool.server.logic.audit import record
from computepool.server.policy import authorize
from computepool.store import usage as sql
from computepool.store.db import db_now
from computepool.store.models import Allocation, Node, Price, Tenant
from computepool.wire.common import Items
from computepool.wire.usage import (
    DeviceSampleOut,
    PartitionOut,
    PriceIn,
    PriceOut,
    StaticEquivalentOut,
    UsageItem,
    UsageOut,
)

J_PER_KWH = 3.6e6
MAX_HISTORY_POINTS = 720  # per device: a longer window is thinned to this many evenly spaced points
MAX_JOB_ROWS = 10_000  # by=job: rows past this are left out and the answer says so
_DIGITS = 6


def parse_when(
    text: str | None, now: datetime, default: str, field: str, *, to_hour: bool = False
) -> datetime:
    """`30m`, `12h`, `7d` (that long ago) or an ISO 8601 time (UTC when no zone is given)."""
    raw = (text or default).strip()
    try:
        try:
            at = datetime.fromisoformat(raw)
            if at.tzinfo is None:
                at = at.replace(tzinfo=UTC)
        except ValueError:
            at = now - timedelta(seconds=parse_duration_s(raw, field))
        at = at.astimezone(UTC)
    except (InvalidInput, ValueError, OverflowError):
        raise Invalid(
            f"{field}: expected an ISO 8601 time or a duration such as 30m, 12h or 7d, got {raw!r}", field
        ) from None
    return at.replace(minute=0, second=0, microsecond=0) if to_hour else at


def _window(s: Session, since: str | None, until: str | None, default: str) -> tuple[datetime, datetime]:
    now = db_now(s)
    start = parse_when(since, now, default, "since", to_hour=True)
    end = min(parse_when(until, now, "0s", "until"), now) if until else now  # nothing is booked ahead
    if end <= start:
        raise Invalid(f"until ({end.isoformat()}) is not after since ({start.isoformat()})", "until")
    return start, end


def _prices(s: Session) -> dict[str, float]:
    return {p.item: p.amount for p in sql.prices(s)}


# -- usage ----------------------------------------------------------------------------------------


def usage(ctx: Ctx, by: UsageBy, since: str | None, until: str | None) -> UsageOut:
    scope = authorize(ctx.caller(), ctx.action)
    with ctx.db.read() as s:
        start, end = _window(s, since, until, "7d")
        rows = sql.grouped(s, by, start, end, scope.tenant, limit=MAX_JOB_ROWS if by == "job" else None)
        prices = _prices(s)
    truncated = by == "job" and len(rows) > MAX_JOB_ROWS
    if truncated:  # drop the last allocation's rows too: some of its models may be past the cut
        rows = [r for r in rows[:MAX_JOB_ROWS] if r["allocation_id"] != rows[MAX_JOB_ROWS]["allocation_id"]]
    keys = sql.GROUP_COLUMNS[by]
    groups: dict[tuple[object, ...], dict[str, float]] = {}
    unpriced: set[str] = set()
    for m in rows:
        key = tuple(m[k] for k in keys) if keys else (m["model"],)
        g = groups.setdefault(key, dict.fromkeys(("gpu", "cpu", "mem", "kwh", "waste", "cost"), 0.0))
        gpu_h = float(m["gpu_seconds"] or 0) / 3600
        kwh = float(m["energy_j"] or 0) / J_PER_KWH
        g["gpu"] += gpu_h
        g["cpu"] += float(m["cpu_seconds"] or 0) / 3600
        g["mem"] += float(m["memory_mib_seconds"] or 0) / 1024 / 3600
        g["kwh"] += kwh
        g["waste"] += float(m["idle_waste_j"] or 0) / J_PER_KWH
        g["cost"] += gpu_h * prices.get(m["model"], 0.0) + kwh * prices.get(ENERGY_ITEM, 0.0)
        if gpu_h > 0 and m["model"] not in prices:
            unpriced.add(m["model"])
        if kwh > 0 and ENERGY_ITEM not in prices:
            unpriced.add(ENERGY_ITEM)
    items = []

    def order(kv: tuple[tuple[object, ...], dict[str, float]]) -> tuple[str, ...]:
        return tuple(f"{k:020d}" if isinstance(k, int) else str(k) for k in kv[0])  # ids by number

    for key, g in sorted(groups.items(), key=order):
        fields: dict[str, object] = dict(zip(keys or ("model",), key, strict=True))
        if fields.get("tenant") == "":
            fields["tenant"] = POOL_TENANT  # the pool's own row: devices that held nothing
        items.append(
            UsageItem.model_validate(
                {
                    **fields,
                    "gpu_hours": round(g["gpu"], _DIGITS),
                    "cpu_hours": round(g["cpu"], _DIGITS),
                    "memory_gib_hours": round(g["mem"], _DIGITS),
                    "energy_kwh": round(g["kwh"], _DIGITS),
                    "idle_waste_kwh": round(g["waste"], _DIGITS),
                    "cost": round(g["cost"], _DIGITS),
                }
            )
        )
    return UsageOut(items=items, unpriced=sorted(unpriced), truncated=truncated)


# -- prices ---------------------------------------------------------------------------------------


def _price_out(p: Price) -> PriceOut:
    return PriceOut(item=p.item, amount=p.amount, updated_at=p.updated_at)


def list_prices(ctx: Ctx) -> Items[PriceOut]:
    authorize(ctx.caller(), ctx.action)
    with ctx.db.read() as s:
        return Items[PriceOut](items=[_price_out(p) for p in sql.prices(s)])


def set_price(ctx: Ctx, item: str, body: PriceIn) -> PriceOut:
    authorize(ctx.caller(), ctx.action)
    with ctx.db.write() as s:
        row = sql.set_price(s, item, body.amount, db_now(s))
        record(s, ctx, f"price:{item}", detail={"amount": body.amount})
        out = _price_out(row)
        known = sql.known_models(s)
    if item != ENERGY_ITEM and item not in known:
        out.warning = _unused_price(item, known)
    return out


def _unused_price(item: str, known: set[str]) -> str:
    """Why a price set for `item` will cost nothing, and the model names that would."""
    near = difflib.get_close_matches(item, sorted(known), n=1, cutoff=0.5)
    near += [m for m in sorted(known) if not near and (m in item or item in m)][:1]
    models = ", ".join(sorted(known)[:10]) or "none yet"
    hint = f"; did you mean {near[0]}?" if near else ""
    return f"no device of the pool is a {item!r}: this price applies to nothing yet (models: {models}){hint}"


def delete_price(ctx: Ctx, item: str) -> PriceOut:
    authorize(ctx.caller(), ctx.action)
    with ctx.db.write() as s:
        row = s.get(Price, item)
        if row is None:
            raise NotFound.of("price", item, "item")
        out = _price_out(row)
        sql.delete_price(s, item)
        record(s, ctx, f"price:{item}", detail={"deleted": True, "amount": out.amount})
        return out


# -- device history -------------------------------------------------------------------------------


def node_history(ctx: Ctx, name: str, since: str | None) -> Items[DeviceSampleOut]:
    authorize(ctx.caller(), ctx.action)
    with ctx.db.read() as s:
        if not sql.node_exists(s, name):
            raise NotFound.of("node", name)
        now = db_now(s)
        start = parse_when(since, now, "1h", "since")
        rows = sql.history(s, name, start, now + timedelta(seconds=1), MAX_HISTORY_POINTS)
    items = [
        DeviceSampleOut(device_index=i, at=at, utilization_pct=u, used_memory_mib=m, power_w=w)
        for i, at, u, m, w in rows
    ]
    return Items[DeviceSampleOut](items=items)


# -- the static equivalent ------------------------------------------------------------------------


def _pool_start(s: Session) -> datetime | None:
    """The pool's first record: its first tenant, node or allocation (None for an empty pool)."""
    firsts = [
        s.execute(select(func.min(col))).scalar_one_or_none()
        for col in (Tenant.created_at, Node.joined_at, Allocation.created_at)
    ]
    known = [t for t in firsts if t is not None]
    return min(known) if known else None


def static_equivalent(ctx: Ctx, since: str | None, until: str | None) -> StaticEquivalentOut:
    scope = authorize(ctx.caller(), ctx.action)
    with ctx.db.read() as s:
        start, end = _window(s, since, until, "30d")
        born = _pool_start(s)
        clipped = born is not None and start < born < end
        if clipped and born is not None:  # idle static devices are charged only while the pool was
            start = born
        pasts = sql.history_of_allocations(s, start, end, scope.tenant)
        models = sql.device_models(s)
        energy = sql.energy_by_model(s, start, end, scope.tenant)
        prices = _prices(s)
    intervals = [iv for p in pasts for iv in se.intervals_of(p, models, end)]
    cmp = se.compare(intervals, start, end)
    hours = (end - start).total_seconds() / 3600
    static = cmp.static_devices
    size: dict[str, int] = {}
    for model in models.values():
        size[model] = size.get(model, 0) + 1
    by_model: dict[str, dict[str, int]] = {}
    cost_pool = cost_static = energy_pool = extra_j = 0.0
    for model in sorted(cmp.pool_devices):
        pool_n, static_n = cmp.pool_devices[model], static.get(model, 0)
        by_model[model] = {
            "pool_devices": pool_n,
            "static_devices": static_n,
            "pool_size_devices": size.get(model, 0),
        }
        price = prices.get(model, 0.0)
        cost_pool += pool_n * hours * price
        cost_static += static_n * hours * price
        energy_pool += energy.get(model, 0.0)
        extra_j += (static_n - pool_n) * se.idle_watts(model) * hours * 3600
    pool_total, static_total = sum(cmp.pool_devices.values()), sum(static.values())
    saved = static_total - pool_total
    kwh_price = prices.get(ENERGY_ITEM, 0.0)
    e_pool, e_static = energy_pool / J_PER_KWH, (energy_pool + extra_j) / J_PER_KWH
    cost_pool += e_pool * kwh_price
    cost_static += e_static * kwh_price
    return StaticEquivalentOut(
        since=start,
        until=end,
        clipped=clipped,
        pool_devices=pool_total,
        pool_size_devices=len(models),
        static_devices=static_total,
        devices_saved=saved,
        devices_saved_pct=round(100.0 * saved / static_total, 2) if static_total else 0.0,
        cost_pool=round(cost_pool, _DIGITS),
        cost_static=round(cost_static, _DIGITS),
        cost_saved=round(cost_static - cost_pool, _DIGITS),
        energy_pool_kwh=round(e_pool, _DIGITS),
        energy_pool_includes_empty=scope.tenant is None,
        energy_static_kwh=round(e_static, _DIGITS),
        energy_saved_kwh=round(e_static - e_pool, _DIGITS),
        tenants=[
            PartitionOut(
                tenant=p.tenant,
                model=p.model,
                static_devices=p.static_devices,
                peak_gpus=p.peak_milli / 1000,
                peak_at=p.peak_at,
            )
            for p in cmp.partitions
        ],
        models=by_model,
        method=se.METHOD,
    )
