"""What one ledger pass books: arithmetic only, no I/O, so that its sums can be checked alone.

A pass covers [start, end). Every allocation that held devices at some time in it books, for the
part it held (from its bind, or `start`, to its end, or `end`), its device share × seconds as
GPU-seconds and its host share's cores × seconds and MiB × seconds: an allocation that started or
ended between passes books exactly its own time. Energy is measured per device and then handed
out:

1. the device's total-energy counter (NVML), as the difference from the mark the ledger left at
   the previous pass, when both are known, the difference is not negative (a driver reload resets
   the counter) and it is below `PLAUSIBLE_W` × (seconds + `slack_s`, a heartbeat interval: the
   counter is as old as the node's last report). It covers the whole pass, however long;
2. else the power the last heartbeat reported × seconds;
3. else the per-model power model of `core.power` at the reported utilization (idle when none):
   devices whose driver reports no power. A MIG instance (NVML gives neither power nor a counter
   per instance) is modelled as its share of the board, so a board's instances add up to one board.

Estimates (2, 3) cover at most the last `estimate_cap_s` of a pass: after an outage the last
reported power says nothing of the hours before, so those hours book no energy rather than a guess.

A device's energy is taken as drawn evenly over the time it covers, and each stretch goes to the
allocations holding slices on the device during that stretch, in proportion to their compute share
of what is held there then (the pool cannot see which process drew how much: a fair split by share
and time is all it knows). Held but unused (utilization 0) it is also booked as idle waste. A
stretch when the device held nothing books to the pool's own row (allocation 0). Devices whose node
has not been heard from for `lost_after_s` book no energy: nothing is known of them, not even that
they are on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from computepool.core.power import model_power

PLAUSIBLE_W = 3000.0  # no accelerator board draws more: a larger counter step is a reset or garbage
POOL_ALLOCATION = 0  # the pool's own row: energy of devices that held nothing
UNKNOWN_MODEL = "unknown"  # a slice on a device the pool no longer lists


@dataclass(frozen=True)
class Holding:
    """A bound or active allocation: who it is booked to and what it holds."""

    id: int
    tenant: str
    user: str
    job: str
    service: str
    slices: tuple[tuple[str, int, int], ...]  # (node, device index, compute milli)
    host: tuple[tuple[str, int, int], ...]  # (node, cpu milli, memory MiB)
    since: datetime | None = None  # when it began holding, if after the pass's start (its bind)
    until: datetime | None = None  # when it stopped, if before the pass's end (ended or requeued)


@dataclass(frozen=True)
class DeviceState:
    """What the pool last heard of a device."""

    node: str
    index: int
    model: str
    utilization_pct: float | None
    power_w: float | None
    energy_j: float | None  # the vendor's counter, as last reported
    mark_j: float | None  # the counter's value the ledger booked up to
    heard: bool  # its node reported within lost_after_s
    board_share: float = 1.0  # a MIG instance: its part of the board (compute milli / 1000)


@dataclass
class Amounts:
    gpu_seconds: float = 0.0
    cpu_seconds: float = 0.0
    memory_mib_seconds: float = 0.0
    energy_j: float = 0.0
    idle_waste_j: float = 0.0


@dataclass(frozen=True)
class Labels:
    tenant: str
    user: str
    job: str
    service: str


Key = tuple[datetime, int, str, str]  # (hour, allocation id, node, model)
POOL_LABELS = Labels("", "", "", "")


@dataclass
class Booking:
    """A tick's result: amounts per ledger key, who each allocation is, the counters' new marks."""

    entries: dict[Key, Amounts] = field(default_factory=dict)
    labels: dict[int, Labels] = field(default_factory=dict)
    marks: dict[tuple[str, int], float | None] = field(default_factory=dict)
    energy_by_device: dict[tuple[str, int], float] = field(default_factory=dict)
    sources: dict[tuple[str, int], str] = field(default_factory=dict)  # counter | power | model | none


def hour_of(t: datetime) -> datetime:
    return t.replace(minute=0, second=0, microsecond=0)


def hour_parts(start: datetime, end: datetime) -> list[tuple[datetime, float]]:
    """[start, end) cut at whole hours: (hour, fraction of the span in it); empty if end <= start."""
    total = (end - start).total_seconds()
    if total <= 0:
        return []
    out = []
    t = start
    while t < end:
        nxt = min(end, hour_of(t) + timedelta(hours=1))
        out.append((hour_of(t), (nxt - t).total_seconds() / total))
        t = nxt
    return out


def device_energy(d: DeviceState, seconds: float, slack_s: float = 0.0) -> tuple[float, str]:
    """Joules the device used over `seconds`, and how that was known (see the module's order).
    `slack_s`: how much longer than `seconds` a counter step may cover (the heartbeat interval: the
    counter is as old as the node's last report)."""
    if not d.heard:
        return 0.0, "none"
    if d.energy_j is not None and d.mark_j is not None:
        delta = d.energy_j - d.mark_j
        if 0.0 <= delta <= PLAUSIBLE_W * (seconds + slack_s):
            return delta, "counter"
    if d.power_w is not None:
        return d.power_w * seconds, "power"
    return model_power(d.model).watts(d.utilization_pct) * d.board_share * seconds, "model"


def held_span(h: Holding, start: datetime, end: datetime) -> tuple[datetime, datetime] | None:
    """The part of [start, end) the allocation held, or None."""
    a = max(start, h.since) if h.since is not None else start
    b = min(end, h.until) if h.until is not None else end
    return (a, b) if b > a else None


def _cuts(a: datetime, b: datetime, points: Iterable[datetime]) -> list[datetime]:
    """[a, b] cut at the given points and at whole hours, sorted."""
    out = {a, b, *(p for p in points if a < p < b)}
    t = hour_of(a) + timedelta(hours=1)
    while t < b:
        out.add(t)
        t += timedelta(hours=1)
    return sorted(out)


def accrue(
    start: datetime,
    end: datetime,
    holdings: Iterable[Holding],
    devices: Iterable[DeviceState],
    *,
    slack_s: float = 0.0,
    estimate_cap_s: float | None = None,
) -> Booking:
    """Book [start, end): see the module docstring."""
    book = Booking()
    seconds = (end - start).total_seconds()
    devs = {(d.node, d.index): d for d in devices}
    for d in devs.values():
        book.marks[(d.node, d.index)] = d.energy_j
    if seconds <= 0:
        return book

    def amounts(hour: datetime, alloc: int, node: str, model: str) -> Amounts:
        return book.entries.setdefault((hour, alloc, node, model), Amounts())

    held_on: dict[tuple[str, int], list[tuple[int, int, datetime, datetime]]] = {}
    for h in holdings:
        span = held_span(h, start, end)
        if span is None:
            continue
        book.labels[h.id] = Labels(h.tenant, h.user, h.job, h.service)
        parts = [(hour, frac * (span[1] - span[0]).total_seconds()) for hour, frac in hour_parts(*span)]
        for node, index, milli in h.slices:
            dev = devs.get((node, index))
            model = dev.model if dev is not None else UNKNOWN_MODEL
            for hour, secs in parts:
                amounts(hour, h.id, node, model).gpu_seconds += milli / 1000.0 * secs
            held_on.setdefault((node, index), []).append((h.id, milli, *span))
        for node, cpu_milli, memory_mib in h.host:
            for hour, secs in parts:
                a = amounts(hour, h.id, node, "")
                a.cpu_seconds += cpu_milli / 1000.0 * secs
                a.memory_mib_seconds += memory_mib * secs
    for key, d in devs.items():
        joules, source = device_energy(d, seconds, slack_s)
        covered = start
        if source in ("power", "model") and estimate_cap_s is not None and seconds > estimate_cap_s:
            joules *= estimate_cap_s / seconds
            covered = end - timedelta(seconds=estimate_cap_s)
        book.energy_by_device[key] = joules
        book.sources[key] = source
        if joules <= 0.0:
            continue
        rate = joules / (end - covered).total_seconds()
        holders = held_on.get(key, [])
        idle = d.utilization_pct is not None and d.utilization_pct <= 0.0
        cuts = _cuts(covered, end, (t for _, _, a, b in holders for t in (a, b)))
        for p, q in zip(cuts, cuts[1:], strict=False):
            part = rate * (q - p).total_seconds()
            now = [(alloc, milli) for alloc, milli, a, b in holders if a <= p and q <= b and milli > 0]
            total_milli = sum(m for _, m in now)
            if total_milli <= 0:
                amounts(hour_of(p), POOL_ALLOCATION, d.node, d.model).energy_j += part
                book.labels[POOL_ALLOCATION] = POOL_LABELS
                continue
            for alloc, milli in now:
                a = amounts(hour_of(p), alloc, d.node, d.model)
                a.energy_j += part * milli / total_milli
                if idle:
                    a.idle_waste_j += part * milli / total_milli
    return book
