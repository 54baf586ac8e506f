"""One unit per quantity: milli-GPU, MiB, millicores. Human spellings are parsed only here, at the edge."""

from __future__ import annotations

import math
import re

from computepool.core.errors import InvalidInput

MILLI_PER_DEVICE = 1000

_MEM_UNITS = {
    "": 1 / (1024 * 1024),  # plain number = bytes
    "b": 1 / (1024 * 1024),
    "k": 1000 / (1024 * 1024),
    "kb": 1000 / (1024 * 1024),
    "ki": 1 / 1024,
    "kib": 1 / 1024,
    "m": 1000**2 / 1024**2,
    "mb": 1000**2 / 1024**2,
    "mi": 1,
    "mib": 1,
    "g": 1000**3 / 1024**2,
    "gb": 1000**3 / 1024**2,
    "gi": 1024,
    "gib": 1024,
    "t": 1000**4 / 1024**2,
    "tb": 1000**4 / 1024**2,
    "ti": 1024**2,
    "tib": 1024**2,
}
_NUM = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def _split(text: str | int | float, field: str) -> tuple[float, str]:
    if isinstance(text, bool):
        raise InvalidInput(field, f"expected a quantity, got {text!r}")
    if isinstance(text, int | float):
        value, unit = float(text), ""
    else:
        m = _NUM.match(str(text))
        if not m:
            raise InvalidInput(field, f"cannot read quantity {text!r}")
        value, unit = float(m.group(1)), m.group(2)
    if not math.isfinite(value) or value < 0:
        raise InvalidInput(field, f"must be a non-negative number, got {text!r}")
    return value, unit


def parse_memory_mib(text: str | int | float, field: str = "memory") -> int:
    """`10GiB`, `512Mi`, `1.5G` → MiB (rounded up). A bare number is bytes, as in Kubernetes."""
    value, unit = _split(text, field)
    factor = _MEM_UNITS.get(unit.lower())
    if factor is None:
        raise InvalidInput(field, f"unknown memory unit {unit!r} in {text!r} (use MiB, GiB, TiB, MB, GB)")
    return math.ceil(value * factor - 1e-9)


def parse_cpu_milli(text: str | int | float, field: str = "cpu") -> int:
    """`2` cores, `0.5`, or `500m` → millicores."""
    value, unit = _split(text, field)
    if unit == "":
        milli = value * 1000
    elif unit == "m":
        milli = value
    else:
        raise InvalidInput(field, f"unknown CPU unit {unit!r} in {text!r} (use cores like 2 or 0.5, or 500m)")
    if abs(milli - round(milli)) > 1e-6:
        raise InvalidInput(field, f"{text!r} is not a whole number of millicores")
    return round(milli)


def parse_gpu_milli(text: str | int | float, field: str = "gpus") -> tuple[int, int]:
    """`0.5` → (1 device, 500 milli); `2` → (2, 1000); `250m` → (1, 250).

    Returns (device count, milli per device). A fraction of a device is allowed only below one
    device: `1.5` GPUs is rejected because a slice lives on a single device.
    """
    value, unit = _split(text, field)
    if unit == "m":
        value = value / 1000
    elif unit != "":
        raise InvalidInput(field, f"unknown GPU unit {unit!r} in {text!r} (use 0.5, 2 or 500m)")
    if value == 0:
        return 0, 0
    if value < 1:
        milli = round(value * MILLI_PER_DEVICE)
        if milli < 1:
            raise InvalidInput(field, f"{text!r} is below one milli-GPU")
        return 1, milli
    if value != int(value):
        raise InvalidInput(field, f"{text!r}: more than one GPU must be a whole number of devices")
    return int(value), MILLI_PER_DEVICE


def format_mib(mib: int) -> str:
    if mib >= 1024 and mib % 1024 == 0:
        return f"{mib // 1024}GiB"
    if mib >= 1024:
        return f"{mib / 1024:.1f}GiB"
    return f"{mib}MiB"


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*(d|h|min|m|s|)")
MAX_DURATION_S = 366 * 86400


def parse_duration_s(text: str | int | float, field: str = "duration") -> int:
    """`90`, `90s`, `15m`, `2h`, `1d`, `1h30m` → whole seconds (at least 1, at most a year)."""
    if isinstance(text, bool):
        raise InvalidInput(field, f"expected a duration such as 2h or 90m, got {text!r}")
    if isinstance(text, int | float):
        total = float(text)
    else:
        s = str(text).strip().lower()
        pos, total = 0, 0.0
        while pos < len(s):
            m = _DURATION_PART.match(s, pos)
            if not m or m.end() == pos:
                raise InvalidInput(field, f"cannot read duration {text!r} (expected e.g. 90s, 15m, 2h, 1d)")
            total += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
            pos = m.end()
            while pos < len(s) and s[pos] == " ":
                pos += 1
        if not s:
            raise InvalidInput(field, "empty duration (expected e.g. 90s, 15m, 2h, 1d)")
    if not math.isfinite(total) or total < 1:
        raise InvalidInput(field, f"must be at least one second, got {text!r}")
    if total > MAX_DURATION_S:
        raise InvalidInput(field, f"{text!r} is more than a year")
    return int(total)


def format_duration(seconds: int) -> str:
    """Seconds as the largest whole units: 7200 → 2h, 5400 → 1h30m, 45 → 45s."""
    out, rest = [], int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size:
            out.append(f"{rest // size}{unit}")
            rest %= size
    return "".join(out) or "0s"


# Quota resources (pool units) as people name and count them: (name, unit formatter).
RESOURCE_WORDS: dict[str, tuple[str, str]] = {
    "gpu_milli": ("GPU", "gpus"),
    "gpu_memory_mib": ("GPU memory", "mib"),
    "cpu_milli": ("CPU", "cpus"),
    "memory_mib": ("memory", "mib"),
}


def resource_name(resource: str, model: str = "") -> str:
    """`gpu_milli` → `GPU`; with a model, `A100 GPU`; unknown resources keep their own name."""
    name = RESOURCE_WORDS.get(resource, (resource, ""))[0]
    return f"{model} {name}" if model else name


def format_amount(resource: str, value: int | float | None) -> str:
    """A quota amount in the units users type: 1500 gpu_milli → `1.5`, 16384 MiB → `16GiB`."""
    if value is None:
        return "-"
    kind = RESOURCE_WORDS.get(resource, ("", ""))[1]
    if kind in ("gpus", "cpus"):
        return f"{value / 1000:g}"
    if kind == "mib":
        return format_mib(int(value)) if value else "0"
    return f"{value:g}"
