"""Per node, what a pending request lacks there: the filters behind /allocations/{id}/explain,
kept per node instead of counted over the pool, for the pending job's page."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from computepool.scheduler.constraints import LABELS, OK, NodeConstraints, NodeRules
from computepool.scheduler.filters import feasibility
from computepool.server import scheduling
from computepool.server.context import Ctx
from computepool.server.logic import allocations
from computepool.server.web.fmt import num
from computepool.store.models import Allocation
from computepool.wire.allocation_out import ExplainOut

FITS = "fits: waiting for the next cycle"


@dataclass(frozen=True)
class NodeWhy:
    node: str
    lacks: str  # what rejects it, or FITS


@dataclass(frozen=True)
class Explained:
    out: ExplainOut
    nodes: list[NodeWhy]


def explain(ctx: Ctx, alloc_id: int) -> Explained:
    """The API's explanation (it authorizes: another tenant's is "not found") and, while pending,
    the first filter that rejects each node, in the order the scheduler applies them."""
    out = allocations.explain(ctx, alloc_id)
    if out.state != "pending":
        return Explained(out, [])
    with ctx.db.read() as s:
        row = s.get(Allocation, alloc_id)
        request = dict(row.request) if row is not None else {}
        snap = scheduling.load_snapshot(s, ctx.settings)
    world, _running, _stops = scheduling.build_world(snap)
    state = world.state
    req = scheduling.stored_core(request)
    lacks: list[str | None] = [None] * state.n_nodes
    sched = state.schedulable.copy()
    for i in np.flatnonzero(~sched):
        lacks[i] = "not schedulable (cordoned, draining or not ready)"
    rules = state.rules
    if rules is None and req.node_selector:
        rules = NodeConstraints([NodeRules()] * state.n_nodes)
    if rules is not None:
        code = rules.rejections(req)
        for i in np.flatnonzero(sched & (code != OK)):
            lacks[i] = LABELS[int(code[i])]
        sched = sched & (code == OK)
    rows = np.flatnonzero(sched)
    if len(rows):
        uniq, inverse = np.unique(state.class_of[rows], return_inverse=True)
        feas = feasibility(state, state.class_view(uniq), req)
        for k, r in zip(rows.tolist(), feas.reason[inverse].tolist(), strict=True):
            lacks[k] = feas.labels[int(r)] if r >= 0 else None
    found = [NodeWhy(n.name, lacks[i] or FITS) for i, n in enumerate(world.nodes)]
    found += [NodeWhy(n.name, "lost: no heartbeat") for n in snap.nodes if n.name not in world.index]
    return Explained(out, found)


@dataclass(frozen=True)
class QuotaRow:
    what: str
    used: str
    request: str
    guaranteed: str
    limit: str


# quota key → (what, unit, scale)
_UNITS = {
    "gpu_milli": ("GPUs", "GPUs", 1000.0),
    "cpu_milli": ("CPUs", "CPUs", 1000.0),
    "memory_mib": ("host memory", "GiB", 1024.0),
    "gpu_memory_mib": ("GPU memory", "GiB", 1024.0),
}


def _amount(v: Any, key: str) -> str:
    _, unit, scale = _UNITS.get(key, ("", "", 1.0))
    return "none" if v is None else f"{num(float(v) / scale, 2)} {unit}".strip()


def quota_rows(e: Explained | None) -> list[QuotaRow]:
    """The explanation's quota document as rows, per resource (and per device model), in units."""
    if e is None:
        return []
    docs: list[tuple[str, str, dict[str, Any]]] = [
        (k, "", v) for k, v in e.out.quota.items() if k != "models"
    ]
    for model, per in (e.out.quota.get("models") or {}).items():
        docs += [(k, f" ({model})", v) for k, v in per.items()]
    return [
        QuotaRow(
            _UNITS.get(key, (key, "", 1.0))[0] + model,
            _amount(d.get("used"), key),
            _amount(d.get("request"), key),
            _amount(d.get("guaranteed"), key),
            "pool" if d.get("limit") is None else _amount(d["limit"], key),
        )
        for key, model, d in docs
    ]
