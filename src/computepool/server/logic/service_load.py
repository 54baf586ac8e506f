"""Gateways' load reports on services: written by every gateway process, read by the controller.

Each gateway rewrites one `gateway_load` row per service it has seen traffic for about twice a
second. A row older than a few seconds belongs to a gateway that stopped (or is stuck): the
readers ignore it, so a dead gateway's requests never keep replicas up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from computepool.store.models import GatewayLoad

STALE_DELETE_S = 60.0


@dataclass(frozen=True)
class Load:
    """Requests in flight on a service's replicas and waiting for one; per replica allocation
    id its requests in flight."""

    inflight: int
    queued: int
    per_replica: dict[int, int] = field(default_factory=dict)


def fresh_load(
    s: Session, service_ids: Sequence[int], now: datetime, max_age_s: float = 5.0
) -> dict[int, Load]:
    """The load on each service summed over the gateways that reported within `max_age_s`;
    services without a fresh report are absent."""
    if not service_ids:
        return {}
    cutoff = now - timedelta(seconds=max_age_s)
    rows = s.scalars(
        select(GatewayLoad).where(
            GatewayLoad.service_id.in_(list(service_ids)), GatewayLoad.updated_at >= cutoff
        )
    ).all()
    inflight: dict[int, int] = {}
    queued: dict[int, int] = {}
    per: dict[int, dict[int, int]] = {}
    for row in rows:
        sid = row.service_id
        inflight[sid] = inflight.get(sid, 0) + row.inflight
        queued[sid] = queued.get(sid, 0) + row.queued
        replicas = per.setdefault(sid, {})
        for key, count in (row.replicas or {}).items():
            try:
                alloc = int(key)
            except ValueError:
                continue
            replicas[alloc] = replicas.get(alloc, 0) + int(count)
    return {sid: Load(inflight[sid], queued[sid], per[sid]) for sid in inflight}


def write_load(
    s: Session, gateway: str, loads: Mapping[int, Load], requests: Mapping[int, int], now: datetime
) -> None:
    """Upsert this gateway's rows (one per service in `loads`), drop its rows for services no
    longer listed, and delete any gateway's rows older than a minute. The caller commits."""
    existing = {
        row.service_id: row for row in s.scalars(select(GatewayLoad).where(GatewayLoad.gateway == gateway))
    }
    for sid, load in loads.items():
        replicas = {str(alloc): count for alloc, count in load.per_replica.items()}
        row = existing.pop(sid, None)
        if row is None:
            s.add(
                GatewayLoad(
                    gateway=gateway,
                    service_id=sid,
                    inflight=load.inflight,
                    queued=load.queued,
                    replicas=replicas,
                    requests=requests.get(sid, 0),
                    updated_at=now,
                )
            )
        else:
            row.inflight = load.inflight
            row.queued = load.queued
            row.replicas = replicas
            row.requests = requests.get(sid, row.requests)
            row.updated_at = now
    for row in existing.values():
        s.delete(row)
    s.execute(delete(GatewayLoad).where(GatewayLoad.updated_at < now - timedelta(seconds=STALE_DELETE_S)))
