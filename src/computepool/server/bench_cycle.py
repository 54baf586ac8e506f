"""`cpool bench cycle`: one scheduling cycle of the control plane on a large pool, database included.

A fresh database (SQLite in a temporary directory, or the PostgreSQL URL given) is migrated and
filled through the store: N nodes of G GPUs and P pending allocations across tenants. Then the
real `Controller` runs: the first cycle (many binds), steady cycles (nothing changes: nothing
more fits) and churn cycles (some allocations released, as many new ones submitted). Each is
timed end to end — lease, snapshot, decisions, commit — which is what the ≤ 1 s target is about.
"""

from __future__ import annotations

import secrets
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, insert, select, text
from sqlalchemy.engine import make_url

from computepool.server.hub import Hub
from computepool.server.scheduling import Controller, CycleReport
from computepool.server.settings import ServerSettings
from computepool.store import allocations as store
from computepool.store import nodes as node_store
from computepool.store import tenants as tenant_store
from computepool.store.db import Database, db_now
from computepool.store.migrate import upgrade
from computepool.store.models import Allocation, AllocationEvent

SHAPES = ((1, 250), (1, 500), (1, 1000), (2, 1000), (4, 1000), (8, 1000), (0, 1000))


@dataclass(frozen=True)
class CycleBenchSettings:
    nodes: int = 1000
    gpus_per_node: int = 8
    pending: int = 10_000
    tenants: int = 8
    steady_cycles: int = 3
    churn: int = 100
    db_url: str | None = None


def request_doc(k: int, tenant: str) -> dict[str, Any]:
    """The k-th request of the mix: fractions, whole GPUs, multi-GPU, CPU-only, a few gangs."""
    gpus, milli = SHAPES[(k * 7 + k // 13) % len(SHAPES)]
    return {
        "name": None,
        "tenant": tenant,
        "gpus": gpus,
        "gpu_milli": milli,
        "gpu_memory_mib": None,
        "cpu_milli": 4000,
        "memory_mib": 16384,
        "models": None,
        "exclusive": gpus > 0 and milli == 1000,
        "isolation": "exclusive" if milli == 1000 else "timeslice",
        "gang_nodes": 2 if k % 97 == 0 and gpus == 8 else 1,
        "priority": k % 3,
        "command": None,
        "env": None,
        "restartable": False,
    }


def _fill(db: Database, s: CycleBenchSettings) -> list[int]:
    """The nodes, tenants and pending requests; returns the tenants' ids."""
    with db.write() as ses:
        now = db_now(ses)
        tenant_ids = [tenant_store.create(ses, f"t{i}", 1.0 + i % 3, now).id for i in range(s.tenants)]
        for i in range(s.nodes):
            node_store.create(
                ses,
                name=f"node-{i:05d}",
                cpu_milli=128_000,
                memory_mib=1_048_576,
                labels={},
                devices=[
                    node_store.DeviceSpec(
                        j, "nvidia", "A100" if i % 4 else "V100", 81920, f"GPU-{i}-{j}", 1000, "nvl0"
                    )
                    for j in range(s.gpus_per_node)
                ],
                now=now,
            )
    _submit(db, range(s.pending), tenant_ids)
    return tenant_ids


def _submit(db: Database, ks: range, tenant_ids: list[int]) -> None:
    with db.write() as ses:
        now = db_now(ses)
        rows = []
        for k in ks:
            t = k % len(tenant_ids)
            req = request_doc(k, f"t{t}")
            rows.append(
                {
                    "name": "",
                    "tenant_id": tenant_ids[t],
                    "owner": "bench",
                    "idempotency_key": None,
                    "request": req,
                    "priority": req["priority"],
                    "command": None,
                    "env": None,
                    "restartable": False,
                    "state": "pending",
                    "reason": "submitted",
                    "attempt": 1,
                    "term": 0,
                    "nodes": [],
                    "slices": [],
                    "created_at": now,
                }
            )
        for i in range(0, len(rows), 1000):
            ids = ses.scalars(insert(Allocation).returning(Allocation.id), rows[i : i + 1000]).all()
            ses.execute(
                insert(AllocationEvent),
                [
                    {
                        "allocation_id": a,
                        "at": now,
                        "state": "pending",
                        "reason": "submitted",
                        "attempt": 1,
                        "term": 0,
                    }
                    for a in ids
                ],
            )


def _churn(db: Database, n: int, next_k: int, tenant_ids: list[int]) -> None:
    """Release the n oldest bound allocations and submit n new requests."""
    with db.write() as ses:
        now = db_now(ses)
        rows = ses.scalars(
            select(Allocation).where(Allocation.state == "bound").order_by(Allocation.id).limit(n)
        ).all()
        for a in rows:
            store.transition(ses, a, "released", "released by bench", now)
    _submit(db, range(next_k, next_k + n), tenant_ids)


def _figures(r: CycleReport) -> dict[str, Any]:
    res = r.result
    return {
        "seconds": round(r.seconds, 3),
        "snapshot_s": round(r.snapshot_seconds, 3),
        "decide_s": round(r.decide_seconds, 3),
        "commit_s": round(r.commit_seconds, 3),
        "pending": r.pending,
        "binds": len(res.bound) if res else 0,
    }


@contextmanager
def _scratch_database(settings: ServerSettings) -> Iterator[Database]:
    """SQLite in the temporary data dir, or a new PostgreSQL database next to the one given
    (created and dropped here: the database named in the URL is never touched)."""
    url = make_url(settings.database_url)
    if url.get_backend_name() != "postgresql":
        db = Database(settings.database_url)
        try:
            yield db
        finally:
            db.dispose()
        return
    name = f"cpool_bench_{secrets.token_hex(4)}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        db = Database(url.set(database=name).render_as_string(hide_password=False))
        try:
            yield db
        finally:
            db.dispose()
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
    finally:
        admin.dispose()


def run_cycle_bench(s: CycleBenchSettings) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="cpool-cycle-") as tmp:
        settings = ServerSettings(data_dir=Path(tmp), db_url=s.db_url)
        with _scratch_database(settings) as db:
            upgrade(db)
            t0 = time.perf_counter()
            tenant_ids = _fill(db, s)
            fill_s = time.perf_counter() - t0
            ctl = Controller(db, settings, Hub())
            first = ctl.run_once()
            steady = [ctl.run_once() for _ in range(s.steady_cycles)]
            churn = []
            next_k = s.pending
            for _ in range(s.steady_cycles):
                _churn(db, s.churn, next_k, tenant_ids)
                next_k += s.churn
                churn.append(ctl.run_once())
    steady_s = sorted(r.seconds for r in steady)
    churn_s = sorted(r.seconds for r in churn)
    return {
        "database": db.dialect,
        "nodes": s.nodes,
        "gpus": s.nodes * s.gpus_per_node,
        "pending": s.pending,
        "fill_s": round(fill_s, 3),
        "first": _figures(first),
        "steady": [_figures(r) for r in steady],
        "churn": [_figures(r) for r in churn],
        "steady_median_s": round(steady_s[len(steady_s) // 2], 3) if steady_s else None,
        "churn_median_s": round(churn_s[len(churn_s) // 2], 3) if churn_s else None,
        "churn_per_cycle": s.churn,
    }
