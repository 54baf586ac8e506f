"""Formatting for the server-rendered pages: numbers with their units, relative times, asks.

Jinja filters (registered in pages.py); every value they return is plain text, escaped by the
template like any other.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

DASH = "—"


def num(x: float | int | None, digits: int = 1) -> str:
    """A figure with at most `digits` decimals; tiny non-zero ones keep three significant digits."""
    if x is None:
        return DASH
    v = float(x)
    if v != 0 and abs(v) < 10**-digits:
        return f"{v:.3g}"
    text = f"{v:,.{digits}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def pct(x: float | None) -> str:
    return DASH if x is None else f"{num(x, 0)}%"


def of(part: float | None, whole: float | None, unit: str = "", digits: int = 2) -> str:
    """ "2.25 / 5 GPUs": a figure with its denominator and unit."""
    text = f"{num(part, digits)} / {num(whole, digits)}"
    return f"{text} {unit}" if unit else text


def ago(at: datetime | None, now: datetime | None = None) -> str:
    """How long ago, in words a person reads at a glance: "12 s ago", "3 min ago", "2.5 h ago"."""
    if at is None:
        return DASH
    s = max(0.0, ((now or datetime.now(UTC)) - at).total_seconds())
    return f"{span(s)} ago"


def span(seconds: float | None) -> str:
    if seconds is None:
        return DASH
    s = max(0.0, seconds)
    if s < 90:
        return f"{round(s)} s"
    if s < 5400:
        return f"{round(s / 60)} min"
    if s < 172800:
        return f"{num(s / 3600, 1)} h"
    return f"{num(s / 86400, 1)} d"


def stamp(at: datetime | None) -> str:
    return DASH if at is None else at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def asks(req: Any) -> str:
    """What a request asks for, in one line: "0.5 of 1 GPU, 0.1 CPU, 512 MiB"."""
    parts: list[str] = []
    if req.gpus:
        share = f"{num(req.gpu_milli / 1000, 3)} of " if req.gpu_milli < 1000 else ""
        gang = f" × {req.gang_nodes} nodes" if req.gang_nodes > 1 else ""
        parts.append(f"{share}{req.gpus} GPU{'s' if req.gpus > 1 else ''}{gang}")
    if req.mig:
        parts.append(f"MIG {req.mig}")
    if req.cpu_milli:
        parts.append(f"{num(req.cpu_milli / 1000, 2)} CPU")
    if req.memory_mib:
        parts.append(f"{num(req.memory_mib, 0)} MiB")
    return ", ".join(parts) or "none"


def gpus_of(req: Any) -> float:
    """Whole-device GPUs a request holds when placed (a share of one counts as that share)."""
    return float(req.gpus * req.gpu_milli / 1000 * max(1, req.gang_nodes)) if req.gpus else 0.0


def gib(mib: float | None) -> str:
    return DASH if mib is None else f"{num(mib / 1024, 1)} GiB"


def energy(kwh: float | None) -> str:
    """kWh, or Wh below a tenth of a kWh (a young pool's figures stay readable)."""
    if kwh is None:
        return DASH
    return f"{num(kwh * 1000, 1)} Wh" if abs(kwh) < 0.1 else f"{num(kwh, 2)} kWh"


FILTERS = {
    "energy": energy,
    "num": num,
    "pct": pct,
    "of": of,
    "ago": ago,
    "span": span,
    "stamp": stamp,
    "asks": asks,
    "gib": gib,
}
