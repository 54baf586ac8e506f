"""The Usage page: the ledger's rows with a CSV export, GPUs held per tenant over the window
(stacked), efficiency per tenant (GPU-hours used ÷ allocated, from the devices' samples), and
pooled-vs-static savings over the part of the window the pool existed."""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from markupsafe import Markup

from computepool.core.usage import UsageBy
from computepool.server.web.board import HOLDING
from computepool.server.web.charts import Series, timeline
from computepool.server.web.fmt import gpus_of
from computepool.wire.allocation_out import AllocationOut
from computepool.wire.usage import DeviceSampleOut, UsageItem

SINCE = {"1d": "1 day", "7d": "7 days", "30d": "30 days"}
BY: dict[str, UsageBy] = {"tenant": "tenant", "user": "user", "job": "job", "model": "model"}
KEYS = {
    "tenant": ["tenant"],
    "user": ["tenant", "user"],
    "job": ["tenant", "user", "job", "allocation_id"],
    "model": ["model"],
}
MEASURES = [
    ("gpu_hours", "GPU-hours", 2),
    ("cpu_hours", "CPU-hours", 2),
    ("memory_gib_hours", "memory GiB-hours", 1),
    ("energy_kwh", "energy kWh", 3),
    ("idle_waste_kwh", "idle waste kWh", 3),
    ("cost", "cost", 2),
]
BUCKETS = 60
STACK = 8  # colours in style.css (.stack-0 … .stack-7); more tenants share the last


def window(value: str | None) -> str:
    return value if value is not None and value in SINCE else "7d"


def grouping(value: str | None) -> UsageBy:
    return BY.get(value or "", "tenant")


def _cell(v: object) -> object:
    """A name a user chose, made inert for spreadsheets (no formula can start a cell)."""
    if v is None:
        return ""
    return "'" + v if isinstance(v, str) and v[:1] in ("=", "+", "-", "@", "\t", "\r") else v


def csv_text(rows: list[UsageItem], by: str) -> str:
    """The table as CSV: the key columns of `by`, then every measure (a spreadsheet's own figures)."""
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow([*KEYS[by], *(m for m, _, _ in MEASURES)])
    for r in rows:
        w.writerow([*(_cell(getattr(r, k)) for k in KEYS[by]), *(getattr(r, m) for m, _, _ in MEASURES)])
    return out.getvalue()


def _utc(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _span(a: AllocationOut, now: datetime) -> tuple[datetime, datetime] | None:
    if a.bound_at is None:
        return None
    return _utc(a.bound_at), _utc(a.ended_at) if a.ended_at else now


def stacked(allocs: list[AllocationOut], start: datetime, now: datetime) -> tuple[Markup, list[str]]:
    """GPUs held per tenant at each point of [start, now], stacked; and the tenants in order."""
    step = (now - start) / BUCKETS
    times = [start + step * i for i in range(BUCKETS + 1)]
    held: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(times))
    for a in allocs:
        span, gpus = _span(a, now + step), gpus_of(a.request)
        if span is None or not gpus or span[1] < start:
            continue
        for i, t in enumerate(times):
            if span[0] <= t < span[1]:
                held[a.tenant][i] += gpus
    tenants = sorted(held)
    total = [sum(v[i] for v in held.values()) for i in range(len(times))]
    series = [Series(t, f"stack-{min(i, STACK - 1)}", held[t]) for i, t in enumerate(tenants)]
    chart = timeline(series, times, max([1.0, *total]), "GPUs", "GPUs held by tenant", stacked=True)
    return chart, tenants


@dataclass(frozen=True)
class Efficiency:
    tenant: str
    allocated_h: float  # GPU-hours held at the sampled moments
    used_h: float  # of them, busy (the device's utilization, split by share)

    @property
    def ratio(self) -> float | None:
        return self.used_h / self.allocated_h if self.allocated_h > 0 else None


def efficiency(
    allocs: list[AllocationOut], history: dict[str, list[DeviceSampleOut]], start: datetime, now: datetime
) -> list[Efficiency]:
    """Per tenant, at each device sample in the window: the share it held there, and the busy part
    of that share (the device's utilization split over its holders by share). A sample
    stands for the minute after it; unsampled time is left out of both sides."""
    every = timedelta(minutes=1)
    holders: dict[tuple[str, int], list[tuple[AllocationOut, float]]] = defaultdict(list)
    for a in allocs:
        if a.bound_at is None or (a.state not in HOLDING and a.ended_at is None):
            continue
        for s in a.slices:
            holders[(s.node, s.device_index)].append((a, s.compute_milli / 1000))
    alloc_h: dict[str, float] = defaultdict(float)
    used_h: dict[str, float] = defaultdict(float)
    hours = every / timedelta(hours=1)
    for node, samples in history.items():
        for x in samples:
            at = _utc(x.at)
            if at < start or x.utilization_pct is None:
                continue
            on = [
                (a, share)
                for a, share in holders.get((node, x.device_index), [])
                if (sp := _span(a, now)) and sp[0] <= at < sp[1]
            ]
            total = sum(share for _, share in on)
            for a, share in on:
                alloc_h[a.tenant] += share * hours
                used_h[a.tenant] += min(share, x.utilization_pct / 100 * share / total) * hours
    return [Efficiency(t, alloc_h[t], used_h[t]) for t in sorted(alloc_h)]
