"""The Work page's rows: allocations filtered by query parameters, pending pinned on top, a page
at a time. Reads go through the same logic as /api/v1/allocations, so a member sees only its
tenant's work."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import urlencode

from computepool.wire.allocation_out import AllocationOut
from computepool.wire.nodes import NodeOut

LIVE = ("pending", "bound", "active")
STATES = {
    "live": "active and pending",
    "pending": "pending",
    "active": "running (bound or active)",
    "ended": "ended",
    "all": "all",
}
PER_PAGE = 25
MAX_ROWS = 2000  # rows read per page view: the newest, like the API's own limit
FIELDS = ("tenant", "user", "state", "node", "model", "q")


@dataclass(frozen=True)
class Filters:
    tenant: str = ""
    user: str = ""
    state: str = "live"
    node: str = ""
    model: str = ""
    q: str = ""
    page: int = 1
    per: int = PER_PAGE

    @staticmethod
    def parse(params: dict[str, str]) -> Filters:
        """Unknown or malformed values fall back to the defaults (a page never fails on its URL)."""
        text = {k: params.get(k, "").strip()[:100] for k in FIELDS}
        if text["state"] not in STATES:
            text["state"] = "live"
        return Filters(
            **text, page=_int(params, "page", 1, 1, 10**6), per=_int(params, "per", PER_PAGE, 5, 200)
        )

    def query(self, **change: str | int) -> str:
        """This view's query string with `change` applied (empty values left out)."""
        values: dict[str, str | int] = {k: getattr(self, k) for k in (*FIELDS, "page", "per")}
        values.update(change)
        plain = {"page": 1, "per": PER_PAGE}
        return urlencode({k: v for k, v in values.items() if v != "" and plain.get(k) != v})


def _int(params: dict[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = params.get(name, "")
    return min(high, max(low, int(raw))) if raw.isdigit() and len(raw) < 8 else default


@dataclass(frozen=True)
class Row:
    a: AllocationOut
    duration_s: float | None
    models: str


@dataclass(frozen=True)
class WorkView:
    rows: list[Row]
    total: int
    pending: int
    page: int
    pages: int
    filters: Filters
    tenants: list[str]
    users: list[str]
    nodes: list[str]
    models: list[str]


def _in_state(a: AllocationOut, state: str) -> bool:
    if state == "live":
        return a.state in LIVE
    if state == "pending":
        return a.state == "pending"
    if state == "active":
        return a.state in ("bound", "active")
    if state == "ended":
        return a.state not in LIVE
    return True


def _models(a: AllocationOut, by_device: dict[tuple[str, int], str]) -> set[str]:
    held = {by_device[(s.node, s.device_index)] for s in a.slices if (s.node, s.device_index) in by_device}
    return held | set(a.request.models or ())


def _matches(a: AllocationOut, f: Filters, models: set[str]) -> bool:
    if f.tenant and a.tenant != f.tenant:
        return False
    if f.user and a.owner != f.user:
        return False
    if f.node and f.node not in a.nodes:
        return False
    if f.model and f.model not in models:
        return False
    if f.q:
        hay = " ".join([str(a.id), a.name, a.reason, " ".join(a.command or [])]).lower()
        if f.q.lower() not in hay:
            return False
    return _in_state(a, f.state)


def build(
    allocs: list[AllocationOut], nodes: list[NodeOut], f: Filters, now: datetime | None = None
) -> WorkView:
    """Filter, order (pending first, in queue order: priority then age; then newest first), page."""
    now = now or datetime.now(UTC)
    by_device = {(n.name, d.index): d.model for n in nodes for d in n.devices}
    kept: list[Row] = []
    for a in allocs:
        models = _models(a, by_device)
        if not _matches(a, f, models):
            continue
        end = a.ended_at or now
        duration = (end - a.started_at).total_seconds() if a.started_at else None
        kept.append(Row(a, duration, ", ".join(sorted(models))))
    kept.sort(key=lambda r: (0, -r.a.request.priority, r.a.id) if r.a.state == "pending" else (1, 0, -r.a.id))
    pages = max(1, -(-len(kept) // f.per))
    page = min(f.page, pages)
    return WorkView(
        rows=kept[(page - 1) * f.per : page * f.per],
        total=len(kept),
        pending=sum(1 for r in kept if r.a.state == "pending"),
        page=page,
        pages=pages,
        filters=f,
        tenants=sorted({a.tenant for a in allocs}),
        users=sorted({a.owner for a in allocs}),
        nodes=sorted({n.name for n in nodes}),
        models=sorted({d.model for n in nodes for d in n.devices}),
    )
