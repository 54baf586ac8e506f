"""Prices the simulator turns usage into cost with: per GPU-hour by device model, and per kWh.

Kept free of numpy so the command line can read the defaults for its help without loading it.
The defaults are placeholders in an abstract currency unit, not market quotes; every report
states the prices it used.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from computepool.core.errors import InvalidInput

DEFAULT_GPU_HOUR_PRICE = 1.0  # per GPU-hour, any model not priced explicitly (placeholder)
DEFAULT_KWH_PRICE = 0.15  # per kWh (placeholder, about an industrial electricity tariff)


@dataclass(frozen=True)
class Prices:
    """Price per GPU-hour by device model (a default for the others) and per kWh."""

    gpu_hour: Mapping[str, float] = field(default_factory=dict)
    default_gpu_hour: float = DEFAULT_GPU_HOUR_PRICE
    kwh: float = DEFAULT_KWH_PRICE

    def per_gpu_hour(self, model: str) -> float:
        return self.gpu_hour.get(model, self.default_gpu_hour)

    def as_dict(self, models: Iterable[str] = ()) -> dict[str, object]:
        per = {m: self.per_gpu_hour(m) for m in sorted(set(models) | set(self.gpu_hour))}
        return {"gpu_hour": per, "default_gpu_hour": self.default_gpu_hour, "kwh": self.kwh}

    @classmethod
    def parse(
        cls,
        items: Iterable[str],
        default_gpu_hour: float = DEFAULT_GPU_HOUR_PRICE,
        kwh: float = DEFAULT_KWH_PRICE,
        option: str = "--gpu-price",
    ) -> Prices:
        """`MODEL=AMOUNT` items (e.g. `V100M32=2.5`); amounts must be finite and non-negative."""
        per: dict[str, float] = {}
        for raw in items:
            model, eq, amount = raw.partition("=")
            if not eq or not model.strip():
                raise InvalidInput(option, f"{raw!r} is not MODEL=AMOUNT (example: V100M32=2.5)")
            per[model.strip()] = _amount(amount, f"{option} {model.strip()}")
        return cls(
            per,
            _amount(str(default_gpu_hour), "--gpu-price-default"),
            _amount(str(kwh), "--kwh-price"),
        )


def _amount(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise InvalidInput(where, f"{text.strip()!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise InvalidInput(where, f"{text.strip()} must be a finite, non-negative amount")
    return value
