"""Energy and cost of a simulated cluster, from the power model the pool itself uses.

The simulator has no power meter, so a device's draw comes from `core.power`: idle power plus
(peak − idle) × utilization, with utilization taken to be the share of the device that work
holds (the stated assumption: allocated work keeps its share busy). From that:

- a device holding work draws at its utilization (`busy_kwh`); a whole device held for a small
  request works at that request's share;
- a device held but doing nothing (a gang's spare GPUs on its last node) draws idle power
  (`idle_held_kwh`, the waste of allocated-but-idle devices);
- a device holding nothing draws idle power when empty devices are taken to be powered on (the
  default: clusters rarely power GPUs off between jobs), else nothing (`idle_empty_kwh`).

Cost is what the devices and their electricity cost over the period: every device of the
cluster at its model's price per GPU-hour (owned or rented capacity costs the same busy or not),
plus energy at the price per kWh. The prices are options; the defaults are placeholders in an
abstract currency unit (`sim.prices`), stated in every report, not market quotes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from computepool.core.power import model_power
from computepool.sim.prices import Prices

if TYPE_CHECKING:
    from computepool.sim.replay.results import ReplayResult

J_PER_KWH = 3.6e6
UTILIZATION_ASSUMPTION = (
    "utilization = the share of the device that placed work holds; draw = idle + (peak - idle) x "
    "utilization (linear model of computepool.core.power)"
)


def power_model(models: Iterable[str], empty_powered: bool) -> dict[str, object]:
    """The idle/peak watts and their sources for these models, and the assumptions, for reports."""
    per = {}
    for m in sorted(set(models)):
        pm = model_power(m)
        per[m] = {"idle_w": pm.idle_w, "peak_w": pm.peak_w, "source": pm.source}
    return {
        "models": per,
        "utilization": UTILIZATION_ASSUMPTION,
        "empty_devices": (
            "powered on, drawing idle power" if empty_powered else "powered off, drawing nothing"
        ),
        "cost": "every device of the cluster at its price per GPU-hour, plus energy at the price per kWh",
    }


@dataclass(frozen=True)
class Energy:
    """Energy and cost of one run over `hours`; `served_gpu_hours` is the work the requests asked."""

    hours: float
    devices: int
    busy_kwh: float
    idle_held_kwh: float
    idle_empty_kwh: float
    energy_kwh: float
    served_gpu_hours: float
    cost_devices: float
    cost_energy: float
    cost: float
    kwh_per_served_gpu_hour: float
    cost_per_served_gpu_hour: float
    lost_kwh: float = 0.0

    def as_dict(self) -> dict[str, float | int]:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def _energy(
    hours: float,
    devices: int,
    busy_j: float,
    idle_held_j: float,
    idle_empty_j: float,
    served_gpu_hours: float,
    cost_devices: float,
    prices: Prices,
    lost_j: float = 0.0,
) -> Energy:
    busy, held, empty = busy_j / J_PER_KWH, idle_held_j / J_PER_KWH, idle_empty_j / J_PER_KWH
    total = busy + held + empty
    cost_energy = total * prices.kwh
    cost = cost_devices + cost_energy
    per = served_gpu_hours if served_gpu_hours > 0 else float("nan")
    return Energy(
        hours=hours,
        devices=devices,
        busy_kwh=busy,
        idle_held_kwh=held,
        idle_empty_kwh=empty,
        energy_kwh=total,
        served_gpu_hours=served_gpu_hours,
        cost_devices=cost_devices,
        cost_energy=cost_energy,
        cost=cost,
        kwh_per_served_gpu_hour=total / per,
        cost_per_served_gpu_hour=cost / per,
        lost_kwh=lost_j / J_PER_KWH,
    )


def snapshot_energy(
    device_models: list[str],
    capacity: np.ndarray,
    held: np.ndarray,
    used: np.ndarray,
    prices: Prices,
    *,
    hours: float = 1.0,
    empty_powered: bool = True,
) -> Energy:
    """Energy of a placement held for `hours`, per device: capacity, held and used milli.

    `used` is what the requests asked (a static whole-device slot around a 300-milli request
    holds 1000 and uses 300); `served_gpu_hours` counts `used`.
    """
    cap = np.asarray(capacity, dtype=np.float64)
    held_a = np.asarray(held, dtype=np.float64)
    used_a = np.minimum(np.asarray(used, dtype=np.float64), held_a)
    idle = np.array([model_power(m).idle_w for m in device_models])
    peak = np.array([model_power(m).peak_w for m in device_models])
    util = np.divide(used_a, cap, out=np.zeros_like(cap), where=cap > 0)
    s = hours * 3600.0
    working = used_a > 0
    holding = (held_a > 0) & ~working
    empty = held_a <= 0
    busy_j = float(((idle + (peak - idle) * util) * working).sum() * s)
    idle_held_j = float((idle * holding).sum() * s)
    idle_empty_j = float((idle * empty).sum() * s) if empty_powered else 0.0
    price = np.array([prices.per_gpu_hour(m) for m in device_models])
    return _energy(
        hours,
        len(device_models),
        busy_j,
        idle_held_j,
        idle_empty_j,
        float(used_a.sum() / 1000.0 * hours),
        float(price.sum() * hours),
        prices,
    )


def timed_energy(
    model: str,
    devices: int,
    window_s: float,
    used_gpu_s: float,
    held_gpu_s: float,
    lost_used_gpu_s: float,
    prices: Prices,
    *,
    empty_powered: bool = True,
) -> Energy:
    """Energy of `devices` whole GPUs of one model over `window_s`, from GPU-seconds.

    Used GPU-seconds run at full utilization (a whole-GPU job keeps its GPUs busy); held but
    unused ones (a gang's spare GPUs on its last node) idle; the rest of the cluster's
    GPU-seconds are empty. Preempted runs are in `used` too (the energy was spent), and their
    share is reported again as `lost_kwh`.
    """
    pm = model_power(model)
    hours = window_s / 3600.0
    empty_s = max(0.0, devices * window_s - held_gpu_s)
    return _energy(
        hours,
        devices,
        used_gpu_s * pm.peak_w,
        max(0.0, held_gpu_s - used_gpu_s) * pm.idle_w,
        empty_s * pm.idle_w if empty_powered else 0.0,
        (used_gpu_s - lost_used_gpu_s) / 3600.0,
        devices * hours * prices.per_gpu_hour(model),
        prices,
        lost_j=lost_used_gpu_s * pm.peak_w,
    )


def saving(base: Energy, other: Energy) -> dict[str, float]:
    """What `other` saves against `base` (positive: less), in kWh, cost and percent."""

    def pct(a: float, b: float) -> float:
        return round(100.0 * (a - b) / a, 2) if a else 0.0

    return {
        "energy_saved_kwh": round(base.energy_kwh - other.energy_kwh, 4),
        "energy_saved_pct": pct(base.energy_kwh, other.energy_kwh),
        "cost_saved": round(base.cost - other.cost, 4),
        "cost_saved_pct": pct(base.cost, other.cost),
    }


def replay_energy(
    result: ReplayResult,
    model: str,
    prices: Prices,
    *,
    horizon_s: float | None = None,
    empty_powered: bool = True,
) -> Energy:
    """Energy and cost of a Philly replay over `horizon_s` (default: its own window).

    Compare two replays over the same horizon (the longer window): a cluster that finishes its
    work earlier still exists, idle, until the other one is done.
    """
    window = result.window_s if horizon_s is None else max(horizon_s, result.window_s)
    return timed_energy(
        model,
        result.gpus,
        window,
        result.used_gpu_s,
        result.held_gpu_s,
        result.lost_used_gpu_s,
        prices,
        empty_powered=empty_powered,
    )


def compare_replays(
    runs: dict[str, ReplayResult],
    model: str,
    prices: Prices,
    *,
    empty_powered: bool = True,
) -> dict[str, object]:
    """Energy and cost of several replays over one horizon, and what each saves against the first."""
    horizon = max(r.window_s for r in runs.values())
    figures = {
        name: replay_energy(r, model, prices, horizon_s=horizon, empty_powered=empty_powered)
        for name, r in runs.items()
    }
    base_name = next(iter(figures))
    base = figures[base_name]
    out: dict[str, object] = {"horizon_hours": round(horizon / 3600.0, 2)}
    for name, e in figures.items():
        out[name] = e.as_dict()
        if name != base_name:
            out[f"{name}_vs_{base_name}"] = saving(base, e)
    out["power_model"] = power_model([model], empty_powered)
    out["prices"] = prices.as_dict([model])
    return out
