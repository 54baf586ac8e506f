"""The report's PNG plots. matplotlib's object API (no pyplot), so no global backend state is touched."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from computepool.sim.published import ARRIVED, PublishedPolicy
from computepool.sim.report_figures import PolicyFigures, WorkloadFigures

# Fixed colours so one policy looks the same in every plot.
POLICY_COLOUR = {
    "random": "tab:gray",
    "dotprod": "tab:purple",
    "clustering": "tab:brown",
    "packing": "tab:orange",
    "bestfit": "tab:blue",
    "fgd": "tab:green",
    "default": "tab:red",
}
ZERO_DELAY_S = 1.0  # where a zero queueing delay is drawn on the log axis


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _curve_panels(
    fig: Any,
    figs: WorkloadFigures,
    ours: Callable[[PolicyFigures], np.ndarray],
    theirs: Callable[[PublishedPolicy], np.ndarray],
    ylabel: str,
    zoom: tuple[int, int],
) -> None:
    """Full range on the left, a zoom on the interesting arrived % on the right."""
    axes = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.3]})
    for k, ax in enumerate(axes):
        for p, pf in figs.policies.items():
            colour = POLICY_COLOUR.get(p)
            y = ours(pf)
            if np.isfinite(y).any():
                ax.plot(ARRIVED, y, color=colour, lw=1.6, label=f"{p} (ours)")
            if pf.published is not None:
                yp = theirs(pf.published)
                if np.isfinite(yp).any():
                    ax.plot(ARRIVED, yp, color=colour, lw=1.2, ls="--", label=f"{p} (published)")
        ax.set_xlabel("arrived GPU demand, % of capacity")
        ax.grid(alpha=0.3)
        if k == 0:
            ax.set_ylabel(ylabel)
            ax.set_xlim(0, 130)
        else:
            lo, hi = zoom
            ax.set_xlim(lo, hi)
            ax.set_title(f"zoom: arrived {lo}–{hi}%", fontsize=9)
            vals = [ours(pf)[lo : hi + 1] for pf in figs.policies.values()]
            vals += [theirs(pf.published)[lo : hi + 1] for pf in figs.policies.values() if pf.published]
            finite = np.concatenate([v[np.isfinite(v)] for v in vals]) if vals else np.array([])
            if finite.size:
                pad = max(0.5, 0.05 * float(finite.max() - finite.min()))
                ax.set_ylim(float(finite.min()) - pad, float(finite.max()) + pad)
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(7, len(handles)), fontsize=8)


def plot_alloc(figs: WorkloadFigures, path: Path, seeds: int) -> Path:
    """Allocation % against arrived %: our mean curves (solid) and the published ones (dashed)."""
    fig = _figure(12, 5.4)
    _curve_panels(
        fig, figs, lambda pf: pf.alloc_curve, lambda pp: pp.alloc_curve, "GPU allocation, %", (85, 130)
    )
    fig.suptitle(
        f"Fill-up, workload {figs.workload}: allocation vs arrival "
        f"(solid: ours, mean of {seeds} seed(s); dashed: published, mean of its seeds)",
        fontsize=10,
    )
    fig.savefig(path, format="png")
    return path


def plot_frag(figs: WorkloadFigures, path: Path, seeds: int) -> Path:
    """Fragmentation rate (fragmented / idle GPU milli) against arrived %."""
    fig = _figure(12, 5.4)
    _curve_panels(
        fig,
        figs,
        lambda pf: pf.frag_rate_curve,
        lambda pp: pp.frag_rate_curve,
        "fragmentation rate, %",
        (60, 100),
    )
    fig.suptitle(
        f"Fill-up, workload {figs.workload}: fragmentation rate vs arrival "
        f"(solid: ours, mean of {seeds} seed(s); dashed: published)",
        fontsize=10,
    )
    fig.savefig(path, format="png")
    return path


def plot_queue_cdf(delays: dict[str, np.ndarray], path: Path, scale: float) -> Path:
    """CDF of per-job queueing delay on a log axis; zero delays sit at the left edge."""
    fig = _figure(8, 4.8)
    ax = fig.subplots()
    styles = {"static": ("tab:blue", "-"), "pooled": ("tab:red", "-")}
    top = ZERO_DELAY_S * 10
    for name, q in delays.items():
        if q.size == 0:
            continue
        xs = np.sort(np.maximum(q, ZERO_DELAY_S))
        ys = np.arange(1, xs.size + 1) / xs.size
        xs = np.concatenate(([ZERO_DELAY_S], xs))
        ys = np.concatenate(([float((q <= 0).mean())], ys))
        colour, ls = styles.get(name, ("tab:green", "--"))
        zero = 100.0 * float((q <= 0).mean())
        ax.step(xs, ys, where="post", color=colour, ls=ls, lw=1.6, label=f"{name}: {zero:.1f}% wait 0 s")
        top = max(top, float(xs.max()))
    ax.set_xscale("log")
    ax.set_xlim(ZERO_DELAY_S * 0.8, top * 1.5)
    ax.set_ylim(0, 1.01)
    ticks = [t for t in (1, 60, 3600, 86400, 7 * 86400, 30 * 86400) if t <= top * 1.5]
    ax.set_xticks(ticks, ["0–1 s", "1 min", "1 h", "1 day", "1 week", "30 days"][: len(ticks)])
    ax.set_xlabel("queueing delay (submit to final start); zero delay drawn at the left edge")
    ax.set_ylabel("fraction of jobs")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"Philly, durations x{scale:.3f} (calibrated): queueing delay CDF", fontsize=10)
    fig.savefig(path, format="png")
    return path


def write_plots(
    figs: dict[str, WorkloadFigures],
    out: Path,
    seeds: int,
    delays: dict[str, np.ndarray] | None = None,
    scale: float = 1.0,
) -> tuple[dict[str, str], list[Path]]:
    """Every plot into `out`: (plot key -> file name for report.md, the paths written)."""
    plots: dict[str, str] = {}
    paths: list[Path] = []
    for w, wf in figs.items():
        for kind, fn in (("alloc", plot_alloc), ("frag", plot_frag)):
            p = fn(wf, out / f"{kind}_{w}.png", seeds)
            plots[f"{kind}_{w}"] = p.name
            paths.append(p)
    if delays is not None:
        p = plot_queue_cdf(delays, out / "queue_cdf.png", scale)
        plots["queue_cdf"] = p.name
        paths.append(p)
    return plots, paths
