"""Pooled vs static on the pool's own history: how many whole devices static per-tenant partitions
would have needed to serve the same allocations at the same times (so with no more waiting than
the pool gave them), against the devices the pool had in use.

Static side, per tenant and device model: at every instant the tenant's held device shares are
summed (a whole device is 1, a 250-milli slice 0.25) and rounded up to whole devices; the partition
is the peak of that over the window. Rounding the sum up assumes a tenant's own fractional slices
could always be packed together inside its partition, so this is the fewest devices a static
partition could have had: the savings reported are never overstated.

Pool side, per device model: the peak over the window of the distinct devices holding any work at
the same instant (for a tenant's own view: the devices it held at once). Both sides are peaks of
concurrent holding, so sequential work on different devices counts once on each side.

Only compute share counts (a slice's device memory is not packed separately); a gang's members
count as its devices. An earlier attempt of a requeued allocation kept no record of its slices: it
is counted with the device count and share of its request, on the model of its later slices, and
on the pool side as devices of its own (the pool's peak may then be a little high: savings are
understated, never overstated).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from computepool.core.allocation import HOLDING
from computepool.core.power import model_power
from computepool.server.ledger.accrual import UNKNOWN_MODEL
from computepool.store.usage import Past

METHOD = (
    "Per tenant and device model, the peak over the window of its concurrently held device shares, "
    "rounded up to whole devices at each instant (a lower bound for a static partition serving the "
    "same allocations at the same times), against the peak of whole devices the pool had holding "
    "work at once."
)


@dataclass(frozen=True)
class Interval:
    """One allocation attempt's hold of one device model."""

    tenant: str
    model: str
    start: datetime
    end: datetime
    milli: int  # summed compute share of its slices of that model (1000 = one device)
    devices: frozenset[tuple[str, int]] = frozenset()  # (node, device index) it held


@dataclass
class Partition:
    tenant: str
    model: str
    static_devices: int
    peak_milli: int
    peak_at: datetime | None


@dataclass
class Comparison:
    pool_devices: dict[str, int] = field(default_factory=dict)  # per model
    partitions: list[Partition] = field(default_factory=list)

    @property
    def static_devices(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.partitions:
            out[p.model] = out.get(p.model, 0) + p.static_devices
        return out


def _ceil_devices(milli: int) -> int:
    return -(-milli // 1000)


def peak(intervals: Iterable[Interval]) -> tuple[int, int, datetime | None]:
    """(most whole devices, share in milli then, when) over the intervals' sweep; an interval
    ending at t and one starting at t never overlap."""
    events: list[tuple[datetime, int, int]] = []
    for iv in intervals:
        if iv.end > iv.start and iv.milli > 0:
            events.append((iv.start, 1, iv.milli))
            events.append((iv.end, 0, -iv.milli))
    events.sort()  # ends (0) before starts (1) at the same time
    best, best_milli, best_at, now = 0, 0, None, 0
    for at, _, delta in events:
        now += delta
        if _ceil_devices(now) > best:
            best, best_milli, best_at = _ceil_devices(now), now, at
    return best, best_milli, best_at


def peak_devices(intervals: Iterable[Interval]) -> int:
    """The most distinct devices held at the same instant (an end at t and a start at t do not
    overlap)."""
    events: list[tuple[datetime, int, frozenset[tuple[str, int]]]] = []
    for iv in intervals:
        if iv.end > iv.start and iv.devices:
            events.append((iv.start, 1, iv.devices))
            events.append((iv.end, 0, iv.devices))
    events.sort(key=lambda e: (e[0], e[1]))
    holders: dict[tuple[str, int], int] = {}
    best = 0
    for _, kind, devices in events:
        for d in devices:
            holders[d] = holders.get(d, 0) + (1 if kind else -1)
            if not holders[d]:
                del holders[d]
        best = max(best, len(holders))
    return best


def compare(intervals: Iterable[Interval], since: datetime, until: datetime) -> Comparison:
    """Clip the intervals to [since, until), size each tenant's partition per model, and find the
    pool's peak of devices in use per model."""
    clipped: dict[tuple[str, str], list[Interval]] = {}
    by_model: dict[str, list[Interval]] = {}
    for iv in intervals:
        start, end = max(iv.start, since), min(iv.end, until)
        if end <= start:
            continue
        cut = Interval(iv.tenant, iv.model, start, end, iv.milli, iv.devices)
        clipped.setdefault((iv.tenant, iv.model), []).append(cut)
        by_model.setdefault(iv.model, []).append(cut)
    out = Comparison(pool_devices={m: peak_devices(ivs) for m, ivs in by_model.items()})
    for (tenant, model), ivs in sorted(clipped.items()):
        devices, milli, at = peak(ivs)
        out.partitions.append(Partition(tenant, model, devices, milli, at))
    return out


def idle_watts(model: str) -> float:
    """The draw of a static partition's device waiting for work (core.power's idle figure)."""
    return model_power(model).idle_w


def holding_spans(
    events: Iterable[tuple[datetime, str, int]], until: datetime
) -> list[tuple[datetime, datetime, int]]:
    """(from, to, attempt) of each stretch an allocation held devices, from its state changes;
    one still holding runs to `until`."""
    spans: list[tuple[datetime, datetime, int]] = []
    opened: tuple[datetime, int] | None = None
    for at, state, attempt in events:
        if state in HOLDING and opened is None:
            opened = (at, attempt)
        elif state not in HOLDING and opened is not None:
            spans.append((opened[0], at, opened[1]))
            opened = None
    if opened is not None:
        spans.append((opened[0], until, opened[1]))
    return spans


def intervals_of(past: Past, models: dict[tuple[str, int], str], until: datetime) -> Iterator[Interval]:
    """The allocation's holds, one per attempt and device model."""

    def device(sl: dict[str, Any]) -> tuple[str, int]:
        return str(sl["node"]), int(sl["device_index"])

    milli: dict[str, int] = {}
    held: dict[str, set[tuple[str, int]]] = {}
    for sl in past.slices:
        model = models.get(device(sl), UNKNOWN_MODEL)
        milli[model] = milli.get(model, 0) + int(sl["compute_milli"])
        held.setdefault(model, set()).add(device(sl))
    asked = past.request.get("models") or []
    fallback = next(iter(milli)) if len(milli) == 1 else (str(asked[0]) if len(asked) == 1 else UNKNOWN_MODEL)
    for start, end, attempt in holding_spans(past.events, until):
        if attempt == past.attempt and past.slices:
            for model, m in milli.items():
                yield Interval(past.tenant, model, start, end, m, frozenset(held[model]))
            continue
        # an earlier attempt: its slices were dropped when it was requeued; its request says how much
        gpus = int(past.request.get("gpus") or 0) * int(past.request.get("gang_nodes") or 1)
        share = gpus * int(past.request.get("gpu_milli") or 1000)
        if share > 0:  # devices of its own on the pool side: which ones it held is not known
            own = frozenset((f"attempt {past.id}.{attempt}", i) for i in range(gpus))
            yield Interval(past.tenant, fallback, start, end, share, own)
