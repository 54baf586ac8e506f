"""Speed preference: the order in which to try device models for a job type, fastest first.

The live pool learns each job type's steps/s per device model and device count from the progress
its jobs report (server/logic/throughputs.py); the table it keeps is `hetero.Speeds`' shape, per
tenant. For a request naming a job type, `model_order` ranks the models it may use: measured ones
by their measured speed, unmeasured ones by `DEFAULT_RELATIVE` (a model's published peak speed)
scaled to the job type through the models it was measured on. The scheduler tries the groups in
turn and takes the first where the request fits now, so nothing waits for a fast model while a
slower one is free; without a job type, or with fewer than two models ranked, it places as before.

Pure functions, no I/O; `server/scheduling/decide.py` calls them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence

from computepool.scheduler.hetero import Speeds

# Peak dense FP16 throughput in TFLOPS, on tensor cores where the model has them, from NVIDIA's
# data sheets for each product (SXM parts; PCIe parts run 10-25% lower but rank the same). The
# K80 and P40 have no fast FP16: their FP32 figure (the K80's per GPU, half its two-GPU board's
# 8.73). Only ratios matter, and only where a job type was never measured on the model.
DEFAULT_RELATIVE: dict[str, float] = {
    "H200": 989.0,
    "H100": 989.0,
    "L40S": 362.0,
    "A100": 312.0,
    "A40": 150.0,
    "A10": 125.0,
    "V100": 125.0,
    "L4": 121.0,
    "T4": 65.0,
    "P100": 21.2,
    "P40": 11.8,
    "K80": 4.4,
}
# the longest family first, so that "L40S" is not read as "L40"; a family is not followed by a
# digit ("A10" is not "A100") nor preceded by a letter or digit
_FAMILIES = [
    (f, re.compile(rf"(?<![A-Z0-9]){re.escape(f)}(?![0-9])"))
    for f in sorted(DEFAULT_RELATIVE, key=lambda f: (-len(f), f))
]


def default_speed(model: str) -> float | None:
    """The model's relative speed from `DEFAULT_RELATIVE` (by family: A100-SXM4-80GB → A100);
    None for a model the table does not know."""
    name = model.upper()
    for family, pattern in _FAMILIES:
        if pattern.search(name):
            return DEFAULT_RELATIVE[family]
    return None


def rates_for(speeds: Speeds, job_type: str, devices: int) -> dict[str, float]:
    """Steps/s per model of `job_type` on `devices` devices: as measured at that count, else the
    nearest measured count scaled linearly (ideal scaling; it ranks models alike); {} unknown."""
    try:
        return speeds.of(job_type, devices)[0]
    except KeyError:
        counts = sorted((abs(n - devices), n) for t, n in speeds.rates if t == job_type)
        if not counts:
            return {}
        n = counts[0][1]
        return {m: v * devices / n for m, v in speeds.rates[(job_type, n)].items()}


def estimate(measured: Mapping[str, float], models: Iterable[str]) -> dict[str, float]:
    """Each model's speed: measured where it was, else its default relative speed times the job
    type's measured-to-default ratio (the geometric mean over the measured models the table knows).
    A model with neither, or any model when no measured one is in the table, is left out."""
    ratios = [math.log(v / d) for m, v in measured.items() if v > 0 and (d := default_speed(m)) is not None]
    scale = math.exp(sum(ratios) / len(ratios)) if ratios else None
    out: dict[str, float] = {}
    for m in models:
        if measured.get(m, 0.0) > 0:
            out[m] = measured[m]
        elif scale is not None and (d := default_speed(m)) is not None:
            out[m] = d * scale
    return out


def model_order(rates: Mapping[str, float], models: Sequence[str]) -> list[frozenset[str]] | None:
    """The groups of `models` to try in turn: fastest first (equal speeds together), the models
    with no speed last, together. None (no preference) when fewer than two models have a speed."""
    speeds = estimate(rates, models)
    if len(speeds) < 2:
        return None
    by_speed: dict[float, set[str]] = {}
    for m, v in speeds.items():
        by_speed.setdefault(v, set()).add(m)
    groups = [frozenset(by_speed[v]) for v in sorted(by_speed, reverse=True)]
    rest = frozenset(m for m in models if m not in speeds)
    return groups + ([rest] if rest else [])
