"""What one ledger tick books: arithmetic only, no I/O, so that its sums can be checked alone.

A tick covers [start, end). Every held slice books its device share × seconds as GPU-seconds,
every held host share its cores × seconds and MiB × seconds. Energy is measured per device and
then handed out:

1. the device's total-energy counter (NVML), as the difference from the mark the ledger left at
   the previous tick, when both are known, the difference is not negative (a driver reload resets
   the counter) and it is below `PLAUSIBLE_W` × (seconds + a heartbeat interval: the counter is
   as old as the node's last report);
2. else the power the last heartbeat reported × seconds;
3. else the per-model power model of `core.power` at the reported utilization (idle when none):
   devices whose driver reports no power. A MIG instance (NVML gives no power per instance) is
   modelled as its share of the board, so a board's instances add up to one board.

A device's energy goes to the allocations holding slices on it, in proportion to their compute
share of what is held there (the pool cannot see which process drew how much: a fair split by
share is all it knows). Held but unused (utilization 0) it is also booked as idle waste. A device
holding nothing books its energy to the pool's own row (allocation 0). Devices whose node has not
been heard from for `lost_after_s` book no energy: nothing is known of them, not even that they
are on.

The counter's advance is booked at the pass that sees it, to whoever holds the device then: with
heartbeats every few seconds, energy at the edges of an allocation can land a few seconds early
or late on its neighbour; the total is exact.
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

    def add(self, other: Amounts, factor: float = 1.0) -> None:
        self.gpu_seconds += other.gpu_seconds * factor
        self.cpu_seconds += other.cpu_seconds * factor
        self.memory_mib_seconds += other.memory_mib_seconds * factor
        self.energy_j += other.energy_j * factor
        self.idle_waste_j += other.idle_waste_j * factor


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


def device_energy(
    d: DeviceState, seconds: float, trust_counter: bool, slack_s: float = 0.0
) -> tuple[float, str]:
    """Joules the device used over `seconds`, and how that was known (see the module's order).
    `slack_s`: how much longer than `seconds` a counter step may cover (the heartbeat interval: the
    counter is as old as the node's last report)."""
    if not d.heard:
        return 0.0, "none"
    if trust_counter and d.energy_j is not None and d.mark_j is not None:
        delta = d.energy_j - d.mark_j
        if 0.0 <= delta <= PLAUSIBLE_W * (seconds + slack_s):
            return delta, "counter"
    if d.power_w is not None:
        return d.power_w * seconds, "power"
    return model_power(d.model).watts(d.utilization_pct) * d.board_share * seconds, "model"


def accrue(
    start: datetime,
    end: datetime,
    holdings: Iterable[Holding],
    devices: Iterable[DeviceState],
    *,
    trust_counter: bool = True,
    slack_s: float = 0.0,
) -> Booking:
    """Book [start, end): see the module docstring. `trust_counter` False after a gap the ledger
    did not book, whose counter difference covers more time than this tick."""
    book = Booking()
    seconds = (end - start).total_seconds()
    parts = hour_parts(start, end)
    devs = {(d.node, d.index): d for d in devices}
    for d in devs.values():
        book.marks[(d.node, d.index)] = d.energy_j
    if not parts:
        return book
    whole: dict[tuple[int, str, str], Amounts] = {}

    def amounts(alloc: int, node: str, model: str) -> Amounts:
        return whole.setdefault((alloc, node, model), Amounts())

    held_on: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for h in holdings:
        book.labels[h.id] = Labels(h.tenant, h.user, h.job, h.service)
        for node, index, milli in h.slices:
            dev = devs.get((node, index))
            model = dev.model if dev is not None else UNKNOWN_MODEL
            amounts(h.id, node, model).gpu_seconds += milli / 1000.0 * seconds
            held_on.setdefault((node, index), []).append((h.id, milli))
        for node, cpu_milli, memory_mib in h.host:
            a = amounts(h.id, node, "")
            a.cpu_seconds += cpu_milli / 1000.0 * seconds
            a.memory_mib_seconds += memory_mib * seconds
    for key, d in devs.items():
        joules, source = device_energy(d, seconds, trust_counter, slack_s)
        book.energy_by_device[key] = joules
        book.sources[key] = source
        if joules <= 0.0:
            continue
        holders = held_on.get(key, [])
        total_milli = sum(m for _, m in holders)
        if not holders or total_milli <= 0:
            amounts(POOL_ALLOCATION, d.node, d.model).energy_j += joules
            continue
        idle = d.utilization_pct is not None and d.utilization_pct <= 0.0
        for alloc, milli in holders:
            a = amounts(alloc, d.node, d.model)
            a.energy_j += joules * milli / total_milli
            if idle:
                a.idle_waste_j += joules * milli / total_milli
    if any(k[0] == POOL_ALLOCATION for k in whole):
        book.labels[POOL_ALLOCATION] = POOL_LABELS
    for (alloc, node, model), a in whole.items():
        for hour, frac in parts:
            book.entries.setdefault((hour, alloc, node, model), Amounts()).add(a, frac)
    return book
