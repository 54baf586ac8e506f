"""The Overview's figures: every number with its denominator, a bar per device, the firing
alerts, and 24 hours of GPUs allocated vs used and of the pending count.

The history comes from what the pool keeps already: the devices' samples (used) and the
allocations' own times (allocated, pending), read through the API's logic with the viewer's
scope — a member's allocated and pending lines are its tenant's.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from markupsafe import Markup

from computepool.server.web.charts import Series, bar_words, device_bar, timeline
from computepool.server.web.fmt import gpus_of
from computepool.wire.alerts import AlertOut
from computepool.wire.allocation_out import AllocationOut
from computepool.wire.nodes import NodeOut
from computepool.wire.usage import DeviceSampleOut, UsageItem

HOLDING = ("bound", "active")
WINDOW = timedelta(hours=24)
BUCKETS = 96  # a point every 15 minutes
MIN_SPAN = timedelta(minutes=5)


@dataclass(frozen=True)
class Device:
    node: str
    index: int
    model: str
    capacity: float  # GPUs (a whole device: 1)
    allocated: float
    used: float | None  # GPUs busy: utilization × capacity; None when not measured
    tenants: str
    health: str

    @property
    def bar(self) -> Markup:
        return device_bar(self.allocated, self.used, self.capacity)

    @property
    def words(self) -> str:
        return bar_words(self.allocated, self.used, self.capacity)


@dataclass
class Overview:
    nodes_ready: int = 0
    nodes_total: int = 0
    gpus_total: float = 0.0
    gpus_allocated: float = 0.0
    gpus_used: float | None = None
    running: int = 0
    pending: list[AllocationOut] = field(default_factory=list)
    alerts: list[AlertOut] | None = None
    energy_kwh: float | None = None
    cost: float | None = None
    devices: dict[str, list[Device]] = field(default_factory=dict)
    chart: Markup = Markup("")
    pending_chart: Markup = Markup("")


def _utc(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def held_by_device(allocs: list[AllocationOut]) -> dict[tuple[str, int], list[tuple[AllocationOut, int]]]:
    """(node, device index) → the holding allocations with their compute (milli) there."""
    out: dict[tuple[str, int], list[tuple[AllocationOut, int]]] = defaultdict(list)
    for a in allocs:
        if a.state in HOLDING:
            for s in a.slices:
                out[(s.node, s.device_index)].append((a, s.compute_milli))
    return out


def build(
    nodes: list[NodeOut],
    allocs: list[AllocationOut],
    history: dict[str, list[DeviceSampleOut]],
    usage: list[UsageItem] | None,
    alerts: list[AlertOut] | None,
    now: datetime | None = None,
) -> Overview:
    now = now or datetime.now(UTC)
    held = held_by_device(allocs)
    o = Overview(nodes_total=len(nodes), nodes_ready=sum(1 for n in nodes if n.state == "ready"))
    measured = False
    used_total = 0.0
    for n in nodes:
        row: list[Device] = []
        for d in n.devices:
            cap = d.compute_milli / 1000 or 1.0
            on = held.get((n.name, d.index), [])
            allocated = sum(m for _, m in on) / 1000
            used = None if d.utilization_pct is None else cap * d.utilization_pct / 100
            if used is not None:
                measured = True
                used_total += used
            tenants = ", ".join(dict.fromkeys(a.tenant for a, _ in on))
            row.append(Device(n.name, d.index, d.model, cap, allocated, used, tenants, d.health))
            o.gpus_total += cap
            o.gpus_allocated += allocated
        o.devices[n.name] = row
    o.gpus_used = used_total if measured else None
    o.running = sum(1 for a in allocs if a.state == "active")
    o.pending = sorted((a for a in allocs if a.state == "pending"), key=lambda a: (-a.request.priority, a.id))
    o.alerts = alerts
    if usage is not None:
        o.energy_kwh = sum(u.energy_kwh for u in usage)
        o.cost = sum(u.cost for u in usage)
    o.chart, o.pending_chart = charts(allocs, history, o.gpus_total, now)
    return o


def _bucket_times(now: datetime, earliest: datetime | None) -> list[datetime]:
    """The last 24 hours, or the pool's life when shorter (at least a few minutes): a young pool's
    chart is not a flat line with everything crammed into its last point."""
    start = now - WINDOW
    if earliest is not None and earliest > start:
        start = min(earliest, now - MIN_SPAN)
    step = (now - start) / BUCKETS
    return [start + step * i for i in range(BUCKETS + 1)]


def charts(
    allocs: list[AllocationOut], history: dict[str, list[DeviceSampleOut]], gpus_total: float, now: datetime
) -> tuple[Markup, Markup]:
    """GPUs allocated (from the allocations' bound and end times) and used (the devices' samples,
    averaged per bucket), and how many requests waited at each point."""
    firsts = [_utc(a.created_at) for a in allocs] + [_utc(s.at) for h in history.values() for s in h]
    times = _bucket_times(now, min(firsts, default=None))
    step = (times[-1] - times[0]) / BUCKETS
    allocated = [0.0] * len(times)
    pending = [0.0] * len(times)
    for a in allocs:
        end = _utc(a.ended_at) if a.ended_at else now + step  # still holding: counted at `now`
        bound = _utc(a.bound_at) if a.bound_at else None
        waited_until = bound or end
        gpus = gpus_of(a.request)
        for i, t in enumerate(times):
            if _utc(a.created_at) <= t < waited_until:
                pending[i] += 1
            if bound is not None and gpus and bound <= t < end:
                allocated[i] += gpus
    sums: dict[int, dict[tuple[str, int], list[float]]] = defaultdict(lambda: defaultdict(list))
    start = times[0]
    for node, samples in history.items():
        for s in samples:
            if s.utilization_pct is None:
                continue
            i = round((_utc(s.at) - start) / step)
            if 0 <= i < len(times):
                sums[i][(node, s.device_index)].append(s.utilization_pct / 100)
    used: list[float | None] = [
        sum(sum(v) / len(v) for v in sums[i].values()) if i in sums else None for i in range(len(times))
    ]
    top = max([gpus_total, *allocated, *(u for u in used if u is not None)])
    gpu_chart = timeline(
        [Series("GPUs allocated", "line-alloc", allocated), Series("GPUs used", "line-used", used)],
        times,
        top,
        "GPUs",
        "GPUs allocated and used over the last 24 hours",
    )
    pending_chart = timeline(
        [Series("requests pending", "line-pending", pending)],
        times,
        max(1.0, *pending),
        "pending",
        "requests pending over the last 24 hours",
        height=90,
    )
    return gpu_chart, pending_chart
