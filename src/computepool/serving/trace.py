"""A day-shaped request-rate trace: the load an inference service sees, compressed into seconds.

The rate over the trace's 24 hours (h in [0, 24)) is a floor plus two Gaussian peaks, scaled so
that its highest point is `peak_rps`:

    shape(h) = exp(-((h - 11) / 2.0)² / 2) + 0.85 · exp(-((h - 17) / 1.75)² / 2)
    rate(h)  = peak_rps · (floor + (1 - floor) · shape(h) / max shape)

so the night (00:00–06:00) stays near `floor · peak_rps`, the morning ramps up to the midday peak
(11:00), a dip in the early afternoon is followed by a late-afternoon peak (17:00) and the evening
falls back to the floor. The day is compressed into `day_s` seconds: one trace hour lasts
`day_s / 24` seconds, and rates are requests per real second of the compressed day.

Arrivals are a non-homogeneous Poisson process drawn by thinning (candidate arrivals at
`peak_rps`, each kept with probability rate / peak_rps) from `random.Random(seed)`: the same
seed, rate and length give the same arrival times on every machine and Python version.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any

HOURS = 24.0
MIDDAY_H, MIDDAY_WIDTH_H = 11.0, 2.0
AFTERNOON_H, AFTERNOON_WIDTH_H, AFTERNOON_WEIGHT = 17.0, 1.75, 0.85
MAX_ARRIVALS = 5_000_000  # a guard against a trace that could not be replayed anyway


def _shape(h: float) -> float:
    return math.exp(-0.5 * ((h - MIDDAY_H) / MIDDAY_WIDTH_H) ** 2) + AFTERNOON_WEIGHT * math.exp(
        -0.5 * ((h - AFTERNOON_H) / AFTERNOON_WIDTH_H) ** 2
    )


# the shape's highest point, found once on a fine grid (near the midday peak, lifted by the other)
_SHAPE_MAX = max(_shape(i / 1000) for i in range(int(HOURS * 1000)))


@dataclass(frozen=True)
class DayTrace:
    """The trace's parameters; everything it produces follows from them."""

    seed: int = 7
    day_s: float = 120.0
    peak_rps: float = 6.0
    floor: float = 0.06

    def __post_init__(self) -> None:
        if not self.day_s > 0:
            raise ValueError(f"day_s: must be above 0, got {self.day_s}")
        if not self.peak_rps > 0:
            raise ValueError(f"peak_rps: must be above 0, got {self.peak_rps}")
        if not 0 <= self.floor <= 1:
            raise ValueError(f"floor: must be between 0 and 1, got {self.floor}")
        if self.peak_rps * self.day_s > MAX_ARRIVALS:
            raise ValueError(f"peak_rps × day_s: more than {MAX_ARRIVALS} requests to draw")

    @property
    def hour_s(self) -> float:
        """Seconds of the compressed day per trace hour."""
        return self.day_s / HOURS

    def hour(self, t_s: float) -> float:
        """The trace hour (0–24) at `t_s` seconds into the compressed day."""
        return t_s / self.hour_s

    def rate_at_hour(self, h: float) -> float:
        """Requests per (compressed) second at trace hour `h`."""
        return self.peak_rps * (self.floor + (1 - self.floor) * _shape(h % HOURS) / _SHAPE_MAX)

    def rate(self, t_s: float) -> float:
        """Requests per second at `t_s` seconds into the compressed day."""
        return self.rate_at_hour(self.hour(t_s))

    def arrivals(self) -> list[float]:
        """Arrival times in seconds from the start of the compressed day, ascending."""
        rng = random.Random(self.seed)
        out: list[float] = []
        t = 0.0
        while True:
            t += rng.expovariate(self.peak_rps)
            if t >= self.day_s:
                return out
            if rng.random() * self.peak_rps < self.rate(t):
                out.append(t)

    def expected_requests(self) -> float:
        """The mean number of arrivals over the day (the rate's integral, midpoint rule)."""
        steps = 24 * 60
        return sum(self.rate_at_hour((i + 0.5) * HOURS / steps) for i in range(steps)) * self.day_s / steps

    def per_hour(self, times: list[float]) -> list[int]:
        """How many of `times` fall in each of the 24 trace hours."""
        counts = [0] * int(HOURS)
        for t in times:
            counts[min(int(HOURS) - 1, int(self.hour(t)))] += 1
        return counts

    def describe(self) -> dict[str, Any]:
        """The parameters and the formula, for a report that can be reproduced."""
        return {
            **asdict(self),
            "hour_s": round(self.hour_s, 3),
            "formula": (
                f"rate(h) = peak_rps * (floor + (1 - floor) * shape(h) / max shape), shape(h) = "
                f"exp(-((h-{MIDDAY_H:g})/{MIDDAY_WIDTH_H:g})^2/2) + "
                f"{AFTERNOON_WEIGHT:g} * exp(-((h-{AFTERNOON_H:g})/{AFTERNOON_WIDTH_H:g})^2/2)"
            ),
            "expected_requests": round(self.expected_requests(), 1),
        }
