"""What a request gets when it names no host CPU or memory or time limit, how many processes one
job may run, and the ceilings a tenant's requests stay under (the longest time limit, the largest
job array).

A request without `cpu_milli` or `memory_mib` (or with 0, which means the same) takes its tenant's
default, else the pool's (`ServerSettings.default_*`), at admission: the value is stored in the
request, so the scheduler books it and the node's cgroup enforces it like any other. Nothing runs
unbooked and unlimited. The process limit is not booked: the agent gets the tenant's current one
with each assignment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from computepool.core.quantities import format_duration, format_mib
from computepool.server.context import Ctx
from computepool.server.errors import Invalid
from computepool.server.logic.audit import record
from computepool.server.logic.tenants import visible
from computepool.server.settings import ServerSettings
from computepool.store.models import Tenant
from computepool.wire.tenant_defaults import DefaultName, TenantDefaultsIn, TenantDefaultsOut

_COLUMN: dict[DefaultName, str] = {
    "cpu_milli": "default_cpu_milli",
    "memory_mib": "default_memory_mib",
    "pids_max": "max_pids",
    "time_limit_s": "default_time_limit_s",
    "max_time_limit_s": "max_time_limit_s",
    "max_array": "max_array",
}
# The Tenant columns `resolve` takes, in its order (admission reads them with the pool's shape).
COLUMNS = tuple(getattr(Tenant, c) for c in _COLUMN.values())
_POOL_HAS: tuple[DefaultName, ...] = ("cpu_milli", "memory_mib", "pids_max")  # the rest: none


@dataclass(frozen=True)
class RequestDefaults:
    cpu_milli: int
    memory_mib: int
    pids_max: int
    from_pool: tuple[DefaultName, ...] = ()  # the values that are the pool's, not the tenant's own
    time_limit_s: int | None = None  # what a job without a time limit gets (None: its ceiling)
    max_time_limit_s: int | None = None
    max_array: int | None = None


def resolve(
    settings: ServerSettings,
    cpu_milli: int | None,
    memory_mib: int | None,
    pids_max: int | None,
    time_limit_s: int | None = None,
    max_time_limit_s: int | None = None,
    max_array: int | None = None,
) -> RequestDefaults:
    """A tenant's own values (None: the pool's) made whole."""
    own: dict[DefaultName, int | None] = {
        "cpu_milli": cpu_milli,
        "memory_mib": memory_mib,
        "pids_max": pids_max,
    }
    pool = [name for name, value in own.items() if value is None]
    return RequestDefaults(
        cpu_milli=cpu_milli or settings.default_cpu_milli,
        memory_mib=memory_mib or settings.default_memory_mib,
        pids_max=pids_max or settings.default_pids_max,
        from_pool=tuple(pool),
        time_limit_s=time_limit_s,
        max_time_limit_s=max_time_limit_s,
        max_array=max_array,
    )


def of_tenant(s: Session, settings: ServerSettings, tenant: str) -> RequestDefaults:
    """The tenant's defaults as stored now (the pool's where it has none, or when it is unknown)."""
    row = s.execute(select(*COLUMNS).where(Tenant.name == tenant)).first()
    return resolve(settings, *row) if row is not None else resolve(settings, None, None, None)


def fill(req: dict[str, Any], defaults: RequestDefaults) -> tuple[dict[str, Any], list[str]]:
    """The stored request with the defaults where it names no CPU or memory (or, for a job, no
    time limit), and the fields filled."""
    filled = [f for f in ("cpu_milli", "memory_mib") if not int(req.get(f) or 0)]
    out = dict(req, **{f: getattr(defaults, f) for f in filled}) if filled else req
    limit = defaults.time_limit_s or defaults.max_time_limit_s
    if limit and req.get("time_limit") is None:
        out = dict(out, time_limit=limit)
    return out, filled


def over_ceiling(
    req: dict[str, Any], defaults: RequestDefaults, tenant: str, array_size: int
) -> tuple[str, str] | None:
    """(message, field) when the request asks for more than its tenant's ceilings allow."""
    see = f"(`cpool tenants defaults {tenant}`)"
    top, asked = defaults.max_time_limit_s, req.get("time_limit")
    if top and asked is not None and int(asked) > top:
        return (
            f"time_limit: {format_duration(int(asked))} is over tenant {tenant}'s longest, "
            f"{format_duration(top)} {see}",
            "time_limit",
        )
    if defaults.max_array and array_size > defaults.max_array:
        return (
            f"array: {array_size} jobs is over tenant {tenant}'s largest array, {defaults.max_array} {see}",
            "array",
        )
    return None


def hint(tenant: str, defaults: RequestDefaults, filled: list[str]) -> str:
    """Why a refused request asks for what its sender never wrote."""
    got = {"cpu_milli": f"{defaults.cpu_milli / 1000:g} CPU", "memory_mib": format_mib(defaults.memory_mib)}
    words = " and ".join(got[f] for f in filled)
    return (
        f" (it names no {' or '.join('CPU' if f == 'cpu_milli' else 'memory' for f in filled)}, so it got "
        f"tenant {tenant}'s default of {words}: ask for less, or see `cpool tenants defaults {tenant}`)"
    )


# --- the API: GET/PATCH /tenants/{name}/defaults -------------------------------------------------
def _out(settings: ServerSettings, t: Tenant) -> TenantDefaultsOut:
    d = resolve(settings, *(getattr(t, c) for c in _COLUMN.values()))
    return TenantDefaultsOut(
        tenant=t.name,
        cpu_milli=d.cpu_milli,
        memory_mib=d.memory_mib,
        pids_max=d.pids_max,
        time_limit_s=d.time_limit_s,
        max_time_limit_s=d.max_time_limit_s,
        max_array=d.max_array,
        from_pool=list(d.from_pool),
    )


def get(ctx: Ctx, name: str) -> TenantDefaultsOut:
    with ctx.db.read() as s:
        return _out(ctx.settings, visible(s, ctx, name))


def change(ctx: Ctx, name: str, body: TenantDefaultsIn) -> TenantDefaultsOut:
    """Set the fields given (null: back to the pool's default); later requests get the new values."""
    given = {f: getattr(body, f) for f in _COLUMN if f in body.model_fields_set}
    with ctx.db.write() as s:
        tenant = visible(s, ctx, name)
        after = {f: given.get(f, getattr(tenant, c)) for f, c in _COLUMN.items()}
        default, top = after["time_limit_s"], after["max_time_limit_s"]
        if default and top and default > top:
            field = "time_limit_s" if "time_limit_s" in given else "max_time_limit_s"
            raise Invalid(
                f"{field}: the default time limit ({format_duration(default)}) would be over "
                f"the longest ({format_duration(top)})",
                field,
            )
        for field, value in given.items():
            setattr(tenant, _COLUMN[field], value)
        s.flush()
        record(s, ctx, f"defaults:{name}", tenant=name, detail={"defaults": dict(given)})
        out = _out(ctx.settings, tenant)
    if ctx.caches is not None:
        ctx.caches.shape.invalidate()  # admission reads the defaults with the pool's shape
    return out
