"""Measured speeds: heartbeats' progress reports folded into per-tenant rows, and reading them.

A node's heartbeat says, for each running job that advanced since the last one, its steps/s
(agent/progress.py). A report counts when its allocation names a job type, is active on that node
in that attempt, holds whole devices of one model there and, for a gang, comes from rank 0's node
(every rank runs the same steps: one report per job). It moves the row of (tenant, job type,
device model, devices held in all) by `ALPHA` of the difference: recent speeds weigh most, and one
odd interval (a checkpoint, a slow data loader) moves the mean little. Other reports are dropped
silently: a job may have ended between the agent's read and the heartbeat.

Rows are the tenant's own: its job type names say what it runs. A tenant sees its rows only, an
admin all; the scheduler orders models for a request by its own tenant's rows alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy.orm import Session

from computepool.core.quantities import MILLI_PER_DEVICE
from computepool.server.context import Ctx
from computepool.server.policy import authorize
from computepool.store import throughputs as sql
from computepool.wire.common import Items
from computepool.wire.nodes import ProgressIn
from computepool.wire.throughputs import ThroughputOut

ALPHA = 0.3  # weight of the newest report in the mean


def record_progress(s: Session, node: str, progress: Sequence[ProgressIn], now: datetime) -> int:
    """Fold a heartbeat's progress reports into the table (in the heartbeat's transaction);
    returns how many counted."""
    found = sql.running_on(s, node, (p.allocation_id for p in progress))
    counted = 0
    for p in progress:
        a = found.get(p.allocation_id)
        if a is None or a.attempt != p.attempt:
            continue
        req = a.request
        job_type = req.get("job_type")
        gpus = int(req.get("gpus") or 0)
        whole = int(req.get("gpu_milli") or 0) >= MILLI_PER_DEVICE
        models = set(a.models)
        if not job_type or not gpus or not whole or len(models) != 1 or "" in models:
            continue
        if a.nodes and a.nodes[0] != node:  # a gang's other ranks: rank 0 speaks for the job
            continue
        devices = gpus * max(1, int(req.get("gang_nodes") or 1))
        sql.record(s, a.tenant_id, str(job_type), models.pop(), devices, p.steps_per_s, now, ALPHA)
        counted += 1
    return counted


def list_all(ctx: Ctx, job_type: str | None = None) -> Items[ThroughputOut]:
    """The caller's tenant's rows (an admin: every tenant's), maybe of one job type."""
    scope = authorize(ctx.caller(), ctx.action)
    with ctx.db.read() as s:
        found = sql.rows(s, scope.tenant, job_type)
    return Items[ThroughputOut](
        items=[
            ThroughputOut(
                tenant=r.tenant,
                job_type=r.job_type,
                model=r.model,
                devices=r.devices,
                steps_per_s=r.steps_per_s,
                samples=r.samples,
                updated_at=r.updated_at,
            )
            for r in found
        ]
    )
