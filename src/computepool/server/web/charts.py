"""Inline SVG drawn on the server: device bars and time charts, no script and no chart library.

Lengths and positions are SVG attributes (not inline styles), so the pages' CSP (style-src
'self') holds; every text is escaped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from markupsafe import Markup, escape

from computepool.server.web.fmt import num

BAR_W = 220


def _frac(x: float, whole: float) -> float:
    return 0.0 if whole <= 0 else max(0.0, min(1.0, x / whole))


def device_bar(allocated: float, used: float | None, capacity: float) -> Markup:
    """Two bars whose lengths are the share allocated and the share used; the stretch allocated
    but not used (idle-held) is drawn on the used row, striped and named."""
    a = _frac(allocated, capacity) * BAR_W
    u = _frac(used or 0.0, capacity) * BAR_W
    idle = max(0.0, a - u)
    parts = [
        f'<svg class="bar" width="{BAR_W}" height="22" viewBox="0 0 {BAR_W} 22" role="img" '
        f'aria-label="{escape(bar_words(allocated, used, capacity))}">',
        f'<rect class="track" x="0" y="1" width="{BAR_W}" height="9"/>',
        f'<rect class="alloc" x="0" y="1" width="{a:.1f}" height="9"/>',
        f'<rect class="track" x="0" y="12" width="{BAR_W}" height="9"/>',
    ]
    if used is not None:
        parts.append(f'<rect class="used" x="0" y="12" width="{u:.1f}" height="9"/>')
        if idle > 0.5:
            parts.append(f'<rect class="idle" x="{u:.1f}" y="12" width="{idle:.1f}" height="9"/>')
    parts.append("</svg>")
    return Markup("".join(parts))


def bar_words(allocated: float, used: float | None, capacity: float) -> str:
    a = _frac(allocated, capacity) * 100
    words = f"alloc {num(a, 0)}% · used {'—' if used is None else num(_frac(used, capacity) * 100, 0) + '%'}"
    if used is not None and allocated - used > 0.005 * capacity:
        words += f" · idle-held {num(_frac(allocated - used, capacity) * 100, 0)}%"
    return words


@dataclass(frozen=True)
class Series:
    name: str
    css: str  # the class of its line (colours are in style.css)
    points: Sequence[float | None]  # one per bucket; None: no data (a gap)


def timeline(
    series: Sequence[Series],
    times: Sequence[datetime],
    top: float,
    unit: str,
    label: str,
    *,
    width: int = 720,
    height: int = 160,
    stacked: bool = False,
) -> Markup:
    """Lines (or, `stacked`, areas summed bottom-up) over evenly spaced buckets; y from 0 to `top`."""
    left, right, up, down = 44, 8, 8, 22
    w, h = width - left - right, height - up - down
    top = top if top > 0 else 1.0
    n = max(1, len(times) - 1)

    def x(i: int) -> float:
        return left + w * i / n

    def y(v: float) -> float:
        return up + h - h * max(0.0, min(1.0, v / top))

    out = [
        f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{escape(label)}">',
        f'<rect class="plot" x="{left}" y="{up}" width="{w}" height="{h}"/>',
        f'<text class="tick" x="{left - 4}" y="{up + 9}" text-anchor="end">{escape(num(top, 2))}</text>',
        f'<text class="tick" x="{left - 4}" y="{up + h}" text-anchor="end">0</text>',
        f'<text class="tick" x="{left - 4}" y="{up + h / 2 + 4:.0f}" text-anchor="end">{escape(unit)}</text>',
    ]
    if times:
        for i in (0, len(times) // 2, len(times) - 1):
            anchor = "start" if i == 0 else "end" if i == len(times) - 1 else "middle"
            out.append(
                f'<text class="tick" x="{x(i):.1f}" y="{height - 6}" text-anchor="{anchor}">'
                f"{escape(times[i].strftime('%H:%M'))}</text>"
            )
    base = [0.0] * len(times)
    for s in series:
        if stacked:
            tops = [b + (v or 0.0) for b, v in zip(base, s.points, strict=True)]
            pts = [f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(tops)]
            pts += [f"{x(i):.1f},{y(base[i]):.1f}" for i in range(len(times) - 1, -1, -1)]
            out.append(
                f'<polygon class="{s.css}" points="{" ".join(pts)}"><title>{escape(s.name)}</title></polygon>'
            )
            base = tops
            continue
        run: list[str] = []
        runs: list[list[str]] = []
        for i, v in enumerate(s.points):
            if v is None:
                if run:
                    runs.append(run)
                run = []
            else:
                run.append(f"{x(i):.1f},{y(v):.1f}")
        if run:
            runs.append(run)
        for r in runs:
            out.append(
                f'<polyline class="{s.css}" points="{" ".join(r)}"><title>{escape(s.name)}</title></polyline>'
            )
    out.append("</svg>")
    return Markup("".join(out))


def spark(points: Sequence[tuple[datetime, float]], top: float, css: str, label: str) -> Markup:
    """A small line of (time, value) points, value from 0 to `top`."""
    w, h = 120, 24
    out = [
        f'<svg class="spark" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
        f'role="img" aria-label="{escape(label)}">'
    ]
    if len(points) > 1:
        t0 = points[0][0]
        span = max(1.0, (points[-1][0] - t0).total_seconds())
        xy = [
            f"{(t - t0).total_seconds() / span * (w - 2) + 1:.1f},{h - 1 - _frac(v, top) * (h - 2):.1f}"
            for t, v in points
        ]
        out.append(f'<polyline class="{css}" points="{" ".join(xy)}"/>')
    out.append("</svg>")
    return Markup("".join(out))
