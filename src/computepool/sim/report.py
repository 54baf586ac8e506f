"""One report that reruns every comparison the pool's claims rest on, and writes what a reader needs.

Three studies, each against published figures where there are any:

1. the fill-up protocol on the Alibaba 2023 trace (`sim.fill`), every workload x policy x
   seed, next to the FGD paper's per-policy results, with the offline references;
2. static whole-device allocation against the pool on the same protocol (`sim.sharing`);
3. the Philly replay with queues (`sim.replay`): static VC partitions against one pooled
   cluster at the trace's own load, at the load calibrated to the published queueing delay,
   and the smallest pooled cluster that matches static.

Everything runs in worker processes (`--jobs`); the output is `report.md`, PNG plots and
`results.json` with every raw figure. Plots use matplotlib's object API (no pyplot), so no
global backend state is touched.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from computepool.core.errors import InvalidInput
from computepool.scheduler.policies import POLICIES
from computepool.sim.alibaba import load_nodes, load_pods
from computepool.sim.csvread import float_field, read_rows, traces_dir
from computepool.sim.fill import run_fill
from computepool.sim.philly import PUBLISHED_AVG_QUEUE_S, JobTrace, load_published, load_trace
from computepool.sim.replay import ReplayResult, VcComparison, calibrate, compare, find_parity, replay
from computepool.sim.sharing import static_vs_pooled

ALIBABA_DIR = "alibaba-v2023"
PUBLISHED_DIR = "fgd-published"
PHILLY_DIR = "philly"
NODE_LIST = "openb_node_list_gpu_node.csv"
POD_PREFIX = "openb_pod_list_"
DEFAULT_WORKLOADS = ("default", "cpu050", "cpu100", "gpushare40", "gpushare60", "gpushare80", "gpushare100")
DEFAULT_SEEDS = "42-46"
QUICK_SEEDS = (42,)
QUICK_WORKLOADS = ("default", "gpushare40")
QUICK_POLICIES = ("bestfit", "fgd", "default")
SHARING_WORKLOAD = "default"
SHARING_SEED = 42
# Our policy name -> the published simulator's name; `default` (the pool's own) has none.
PUBLISHED_POLICY = {
    "random": "01-Random",
    "dotprod": "02-DotProd",
    "clustering": "03-GpuClustering",
    "packing": "04-GpuPacking",
    "bestfit": "05-BestFit",
    "fgd": "06-FGD",
}
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
MATCH_PTS = 0.5  # |ours - published| allowed for bestfit and fgd
DEFAULT_MARGIN_PTS = 0.3  # our default may trail published fgd by this much
ARRIVED = np.arange(131)
ZERO_DELAY_S = 1.0  # where a zero queueing delay is drawn on the log axis

Progress = Callable[[int, int], None]


# -- input ---------------------------------------------------------------------------------


def parse_seeds(text: str) -> tuple[int, ...]:
    """`42-46`, `42,44` or a mix (`42-44,50`) -> seeds in the order given, duplicates dropped."""
    seeds: list[int] = []
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise InvalidInput("--seeds", f"{text!r} is not a seed list (examples: 42-46, 42,43, 42-44,50)")
    for part in parts:
        lo_text, dash, hi_text = part.partition("-")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if dash else lo
        except ValueError:
            raise InvalidInput("--seeds", f"{part!r} is not a whole number or a range like 42-46") from None
        if lo < 0:
            raise InvalidInput("--seeds", f"{part!r}: seeds are non-negative")
        if hi < lo:
            raise InvalidInput("--seeds", f"{part!r}: the range ends before it starts")
        if hi - lo >= 1000:
            raise InvalidInput("--seeds", f"{part!r}: more than 1000 seeds in one range")
        seeds.extend(s for s in range(lo, hi + 1) if s not in seeds)
    return tuple(seeds)


def parse_names(text: str, allowed: Sequence[str], option: str) -> tuple[str, ...]:
    """A comma-separated list of names, each one of `allowed`; order kept, duplicates dropped."""
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            raise InvalidInput(option, f"{text!r} has an empty name (give a comma-separated list)")
        if name not in allowed:
            raise InvalidInput(option, f"unknown name {name!r} (choose from {', '.join(allowed)})")
        if name not in names:
            names.append(name)
    return tuple(names)


def available_workloads(traces: Path) -> tuple[str, ...]:
    """Workloads with a pod list under `traces/alibaba-v2023`, the published ones first."""
    found = {p.stem.removeprefix(POD_PREFIX) for p in (traces / ALIBABA_DIR).glob(f"{POD_PREFIX}*.csv")}
    known = [w for w in DEFAULT_WORKLOADS if w in found]
    return tuple(known + sorted(found - set(known)))


def parse_workloads(text: str, traces: Path) -> tuple[str, ...]:
    allowed = available_workloads(traces)
    if not allowed:
        raise InvalidInput(
            "--workloads", f"no {POD_PREFIX}*.csv under {traces / ALIBABA_DIR} (set CPOOL_TRACES)"
        )
    cleaned = ",".join(w.strip().removeprefix(POD_PREFIX) for w in text.split(","))
    return parse_names(cleaned, allowed, "--workloads")


def check_writable(out: Path) -> Path:
    """Create `out` and prove a file can be written there, before any long run starts."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".cpool-probe-"):
            pass
    except OSError as e:
        raise InvalidInput(f"--out {out}", f"cannot write there: {e.strerror or e}") from None
    return out


@dataclass(frozen=True)
class ReportConfig:
    """What to run; built from the command line by `from_options`, which validates it."""

    out: Path
    seeds: tuple[int, ...]
    workloads: tuple[str, ...]
    policies: tuple[str, ...]
    jobs: int = 2
    replay: bool = True
    tune: float = 1.3
    traces: Path = field(default_factory=traces_dir)

    @classmethod
    def from_options(
        cls,
        out: Path,
        seeds: str | None = None,
        workloads: str | None = None,
        policies: str | None = None,
        jobs: int = 2,
        quick: bool = False,
        replay: bool = True,
        traces: Path | None = None,
    ) -> ReportConfig:
        """Explicit options win; `quick` only changes the defaults of the ones not given."""
        base = traces if traces is not None else traces_dir()
        if jobs < 1:
            raise InvalidInput("--jobs", f"{jobs} must be at least 1")
        seed_t = (
            parse_seeds(seeds)
            if seeds is not None
            else (QUICK_SEEDS if quick else parse_seeds(DEFAULT_SEEDS))
        )
        if workloads is not None:
            work_t = parse_workloads(workloads, base)
        else:
            work_t = parse_workloads(",".join(QUICK_WORKLOADS if quick else DEFAULT_WORKLOADS), base)
        pol_t = parse_names(
            policies if policies is not None else ",".join(QUICK_POLICIES if quick else POLICIES),
            POLICIES,
            "--policies",
        )
        cfg = cls(out, seed_t, work_t, pol_t, jobs, replay, traces=base)
        cfg.check_inputs()
        check_writable(out)
        return cfg

    def check_inputs(self) -> None:
        """Every input file the runs need exists (a missing one would only fail much later)."""
        need = [self.traces / ALIBABA_DIR / NODE_LIST]
        need += [self.traces / ALIBABA_DIR / f"{POD_PREFIX}{w}.csv" for w in self.workloads]
        if SHARING_WORKLOAD not in self.workloads:
            need.append(self.traces / ALIBABA_DIR / f"{POD_PREFIX}{SHARING_WORKLOAD}.csv")
        if self.replay:
            need += [self.traces / PHILLY_DIR / n for n in ("philly_jobs.csv", "philly_vc.csv")]
        for path in need:
            if not path.is_file():
                hint = " (or pass --no-replay)" if PHILLY_DIR in path.parts else ""
                raise InvalidInput(str(path), f"trace file not found; set CPOOL_TRACES{hint}")

    @property
    def reference_policy(self) -> str:
        """The policy whose runs also compute the offline references (they depend on the seed only)."""
        return "default" if "default" in self.policies else self.policies[0]


# -- work done in the worker processes (top level, so they can be pickled) ----------------


@dataclass(frozen=True)
class FillTask:
    workload: str
    policy: str
    seed: int
    offline: bool
    tune: float
    traces: str


def run_fill_task(task: FillTask) -> dict[str, Any]:
    """One fill-up run; the raw result (curves included) as a plain dict."""
    base = Path(task.traces) / ALIBABA_DIR
    try:
        nodes = load_nodes(base / NODE_LIST)
        pods = load_pods(base / f"{POD_PREFIX}{task.workload}.csv")
    except InvalidInput as e:  # its two-argument constructor does not survive pickling
        raise ValueError(str(e)) from None
    res = run_fill(
        nodes, pods, task.policy, task.seed, tune=task.tune, workload=task.workload, offline=task.offline
    )
    return dict(res.__dict__)


def run_sharing_task(traces: str, workload: str, seed: int, tune: float) -> dict[str, Any]:
    """Static whole-device allocation vs the pool, on the fill-up protocol."""
    base = Path(traces) / ALIBABA_DIR
    try:
        nodes = load_nodes(base / NODE_LIST)
        pods = load_pods(base / f"{POD_PREFIX}{workload}.csv")
    except InvalidInput as e:
        raise ValueError(str(e)) from None
    return {k: asdict(v) for k, v in static_vs_pooled(nodes, pods, seed, tune).items()}


@dataclass(frozen=True)
class PhillyOutcome:
    """The Philly figures (plain dicts) plus the per-job queueing delays the CDF plot needs."""

    figures: dict[str, Any]
    delays: dict[str, np.ndarray]


def _overall(res: ReplayResult) -> dict[str, Any]:
    out = res.overall.as_dict()
    del out["partition"]
    return {"nodes": res.nodes, "duration_scale": res.duration_scale, **out}


def _delays(trace: JobTrace, res: ReplayResult) -> np.ndarray:
    """Per-job queueing delay (final start - submit); unplaceable jobs (NaN start) left out."""
    q = np.asarray(res.start) - np.asarray(trace.submit)
    return q[np.isfinite(q)]


def run_philly_task(traces: str) -> PhillyOutcome:
    """Static vs pooled at scale 1, calibration, static vs pooled there, and the parity search."""
    base = Path(traces) / PHILLY_DIR
    try:
        trace = load_trace(base / "philly_jobs.csv", base / "philly_vc.csv")
        pub_path = base / "helios_static_vc_published.csv"
        pubs = load_published(pub_path) if pub_path.is_file() else {}
    except InvalidInput as e:
        raise ValueError(str(e)) from None
    target = pubs["all"].queue_avg_s if "all" in pubs else PUBLISHED_AVG_QUEUE_S
    t0 = time.perf_counter()
    s1, p1 = replay(trace, "static", 1.0), replay(trace, "pooled", 1.0)
    cal = calibrate(trace, target)
    scale = cal.duration_scale
    static = cal.result
    pooled = replay(trace, "pooled", scale)
    parity = find_parity(trace, scale, static=static)

    def vc_rows(cmp: Iterable[VcComparison]) -> list[dict[str, Any]]:
        rows = []
        for c in cmp:
            d = c.as_dict()
            pub = pubs.get(c.partition)
            d["published_queue_s"] = pub.queue_avg_s if pub else math.nan
            d["published_jct_s"] = pub.jct_avg_s if pub else math.nan
            rows.append(d)
        return rows

    figures: dict[str, Any] = {
        "jobs": len(trace),
        "vcs": [{"vc": v.name, "nodes": v.nodes, "gpus": v.gpus} for v in trace.vcs],
        "published": {k: asdict(v) for k, v in pubs.items()},
        "scale_1": {"static": s1.as_dict(), "pooled": p1.as_dict()},
        "calibration": {
            "duration_scale": scale,
            "target_avg_queue_s": target,
            "iterations": cal.iterations,
        },
        "calibrated": {"static": static.as_dict(), "pooled": pooled.as_dict()},
        "calibrated_per_vc": vc_rows(compare(static, pooled)),
        "parity": {
            "nodes": parity.nodes,
            "static_nodes": parity.static.nodes,
            "gpus_saved_pct": parity.gpus_saved_pct,
            "static": _overall(parity.static),
            "pooled": _overall(parity.pooled) if parity.pooled is not None else None,
            "probes": [{"nodes": n, "avg_queue_s": q} for n, q in parity.probes],
            "per_vc": vc_rows(parity.per_vc()),
        },
        "elapsed_s": round(time.perf_counter() - t0, 2),
    }
    delays = {"static": _delays(trace, static), "pooled": _delays(trace, pooled)}
    if parity.pooled is not None and parity.nodes is not None:
        delays[f"pooled, {parity.nodes} nodes (parity)"] = _delays(trace, parity.pooled)
    return PhillyOutcome(figures, delays)


# -- published FGD figures -----------------------------------------------------------------


@dataclass(frozen=True)
class PublishedPolicy:
    """The FGD paper's means over its seeds for one workload and policy."""

    n_seeds: int
    unalloc_100: float
    alloc_100_sd: float
    unalloc_130: float
    frag_rate_90: float
    alloc_curve: np.ndarray  # mean allocation % at arrived 0..130 (NaN where missing)
    frag_rate_curve: np.ndarray


def _mean_curves(path: Path) -> dict[tuple[str, str], np.ndarray]:
    """Per (workload, policy) mean over seeds of a discretised curve file (columns 0..130)."""
    cols = ["workload", "sc_policy"] + [str(a) for a in ARRIVED]
    sums: dict[tuple[str, str], list[np.ndarray]] = {}
    for _, row in read_rows(path, cols):
        key = (row["workload"].removeprefix(POD_PREFIX), row["sc_policy"])
        vals = np.array([float(row[str(a)]) if row[str(a)] else math.nan for a in ARRIVED])
        sums.setdefault(key, []).append(vals)
    return {k: np.nanmean(np.vstack(v), axis=0) for k, v in sums.items()}


def load_published_fgd(base: Path) -> dict[tuple[str, str], PublishedPolicy]:
    """Read `fgd-published/` keyed by (workload without prefix, our policy name); {} if absent."""
    summary = base / "summary_by_workload_policy.csv"
    if not summary.is_file():
        return {}
    alloc = (
        _mean_curves(base / "analysis_allo_discrete.csv")
        if (base / "analysis_allo_discrete.csv").is_file()
        else {}
    )
    frag_path = base / "analysis_frag_ratio_discrete.csv"
    frag = _mean_curves(frag_path) if frag_path.is_file() else {}
    ours = {v: k for k, v in PUBLISHED_POLICY.items()}
    nan_curve = np.full(len(ARRIVED), math.nan)
    out: dict[tuple[str, str], PublishedPolicy] = {}
    cols = ["workload", "policy", "n_seeds", "alloc_pct_at_arr100_sd", "unalloc_pct_at_arr100"]
    cols += ["unalloc_pct_at_arr130", "frag_over_idle_pct_at_arr90"]
    for where, row in read_rows(summary, cols):
        policy = ours.get(row["policy"])
        if policy is None:
            continue
        w = row["workload"].removeprefix(POD_PREFIX)
        out[(w, policy)] = PublishedPolicy(
            n_seeds=int(float_field(row, "n_seeds", where)),
            unalloc_100=float_field(row, "unalloc_pct_at_arr100", where),
            alloc_100_sd=float_field(row, "alloc_pct_at_arr100_sd", where),
            unalloc_130=float_field(row, "unalloc_pct_at_arr130", where),
            frag_rate_90=float_field(row, "frag_over_idle_pct_at_arr90", where),
            alloc_curve=alloc.get((w, row["policy"]), nan_curve),
            frag_rate_curve=frag.get((w, row["policy"]), nan_curve),
        )
    return out


# -- aggregation ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation over seeds (sd NaN with fewer than two)."""

    mean: float
    sd: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Stat:
        xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
        if not xs:
            return cls(math.nan, math.nan, 0)
        return cls(statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else math.nan, len(xs))


def _curve(points: list[list[float]]) -> np.ndarray:
    out = np.full(len(ARRIVED), math.nan)
    for a, v in points:
        if 0 <= int(a) < len(out):
            out[int(a)] = v
    return out


def _nanmean_rows(rows: list[np.ndarray]) -> np.ndarray:
    if not rows:
        return np.full(len(ARRIVED), math.nan)
    stack = np.vstack(rows)
    ok = np.isfinite(stack).any(axis=0)
    out = np.full(stack.shape[1], math.nan)
    out[ok] = np.nanmean(stack[:, ok], axis=0)
    return out


@dataclass(frozen=True)
class PolicyFigures:
    """Our figures for one workload and policy over the seeds, with the published ones."""

    workload: str
    policy: str
    unalloc_100: Stat
    unalloc_130: Stat
    frag_rate_90: Stat
    alloc_curve: np.ndarray
    frag_rate_curve: np.ndarray
    published: PublishedPolicy | None

    @property
    def delta_100(self) -> float:
        return self.unalloc_100.mean - self.published.unalloc_100 if self.published else math.nan


@dataclass(frozen=True)
class WorkloadFigures:
    workload: str
    policies: dict[str, PolicyFigures]
    offline_ffd: Stat
    lower_bound: Stat


def aggregate(
    runs: list[dict[str, Any]],
    workloads: Sequence[str],
    policies: Sequence[str],
    published: dict[tuple[str, str], PublishedPolicy],
) -> dict[str, WorkloadFigures]:
    """Means over seeds per workload and policy; offline references from runs that computed them."""
    out: dict[str, WorkloadFigures] = {}
    for w in workloads:
        per: dict[str, PolicyFigures] = {}
        mine = [r for r in runs if r["workload"] == w]
        for p in policies:
            rs = [r for r in mine if r["policy"] == p]
            per[p] = PolicyFigures(
                workload=w,
                policy=p,
                unalloc_100=Stat.of(r["unallocated_pct_at_100"] for r in rs),
                unalloc_130=Stat.of(r["unallocated_pct_at_130"] for r in rs),
                frag_rate_90=Stat.of(r["frag_rate_pct_at_90"] for r in rs),
                alloc_curve=_nanmean_rows([_curve(r["curve"]) for r in rs]),
                frag_rate_curve=_nanmean_rows([_curve(r["frag_rate_curve"]) for r in rs]),
                published=published.get((w, p)),
            )
        out[w] = WorkloadFigures(
            workload=w,
            policies=per,
            offline_ffd=Stat.of(r["offline_ffd_unallocated_pct"] for r in mine),
            lower_bound=Stat.of(r["lower_bound_unallocated_pct"] for r in mine),
        )
    return out


@dataclass(frozen=True)
class SummaryRow:
    """One workload's headline: published vs ours at arrived = 100%, and the pass checks."""

    workload: str
    published_bestfit: float
    ours_bestfit: float
    published_fgd: float
    ours_fgd: float
    ours_default: float
    offline_ffd: float
    lower_bound: float
    bestfit_matches: bool | None
    fgd_matches: bool | None
    default_within_fgd: bool | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarise(
    figs: dict[str, WorkloadFigures], published: dict[tuple[str, str], PublishedPolicy]
) -> list[SummaryRow]:
    """Headline per workload; published figures are shown even for policies not run here."""
    rows = []
    for w, wf in figs.items():

        def ours(p: str, wf: WorkloadFigures = wf) -> float:
            pf = wf.policies.get(p)
            return pf.unalloc_100.mean if pf else math.nan

        def pub(p: str, w: str = w) -> float:
            pp = published.get((w, p))
            return pp.unalloc_100 if pp else math.nan

        def check(ok: bool, *values: float) -> bool | None:
            return ok if all(math.isfinite(v) for v in values) else None

        pb, ob, pg, og, od = pub("bestfit"), ours("bestfit"), pub("fgd"), ours("fgd"), ours("default")
        rows.append(
            SummaryRow(
                workload=w,
                published_bestfit=pb,
                ours_bestfit=ob,
                published_fgd=pg,
                ours_fgd=og,
                ours_default=od,
                offline_ffd=wf.offline_ffd.mean,
                lower_bound=wf.lower_bound.mean,
                bestfit_matches=check(abs(ob - pb) <= MATCH_PTS, ob, pb),
                fgd_matches=check(abs(og - pg) <= MATCH_PTS, og, pg),
                default_within_fgd=check(od <= pg + DEFAULT_MARGIN_PTS, od, pg),
            )
        )
    return rows


# -- plots -----------------------------------------------------------------------------------


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


# -- markdown ---------------------------------------------------------------------------------


def fmt(v: Any, digits: int = 2) -> str:
    """Two decimals, thousands without decimals, '–' for missing; booleans as yes/no."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int | np.integer):
        return f"{int(v):,}"
    x = float(v)
    if not math.isfinite(x):
        return "–"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.{digits}f}"


def _pm(s: Stat) -> str:
    return fmt(s.mean) if not math.isfinite(s.sd) else f"{fmt(s.mean)} ± {fmt(s.sd)}"


def _signed(v: float) -> str:
    return f"{round(v, 2) + 0.0:+.2f}" if math.isfinite(v) else "–"  # + 0.0: no "-0.00"


def md_table(headers: Sequence[str], rows: Iterable[Sequence[str]], right: Iterable[int] = ()) -> str:
    r = set(right)
    lines = ["| " + " | ".join(headers) + " |"]
    lines.append("| " + " | ".join("---:" if i in r else "---" for i in range(len(headers))) + " |")
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


SUMMARY_HEADERS = (
    "workload",
    "pub. bestfit",
    "our bestfit",
    "pub. fgd",
    "our fgd",
    "our default",
    "offline FFD",
    "lower bound",
    f"bestfit ±{MATCH_PTS}",
    f"fgd ±{MATCH_PTS}",
    f"default ≤ pub. fgd+{DEFAULT_MARGIN_PTS}",
)


def summary_cells(r: SummaryRow) -> list[str]:
    return [
        r.workload,
        fmt(r.published_bestfit),
        fmt(r.ours_bestfit),
        fmt(r.published_fgd),
        fmt(r.ours_fgd),
        fmt(r.ours_default),
        fmt(r.offline_ffd),
        fmt(r.lower_bound),
        fmt(r.bestfit_matches),
        fmt(r.fgd_matches),
        fmt(r.default_within_fgd),
    ]


def _workload_section(wf: WorkloadFigures, cfg: ReportConfig, plots: dict[str, str]) -> list[str]:
    rows = []
    for p, pf in wf.policies.items():
        pp = pf.published
        rows.append(
            [
                p,
                str(pf.unalloc_100.n),
                _pm(pf.unalloc_100),
                f"{fmt(pp.unalloc_100)} ± {fmt(pp.alloc_100_sd)}" if pp else "–",
                _signed(pf.delta_100),
                _pm(pf.unalloc_130),
                fmt(pp.unalloc_130) if pp else "–",
                _pm(pf.frag_rate_90),
                fmt(pp.frag_rate_90) if pp else "–",
            ]
        )
    headers = [
        "policy",
        "seeds",
        "ours @100%",
        "published @100%",
        "Δ pts",
        "ours @130%",
        "published @130%",
        "frag rate @90% (ours)",
        "frag rate @90% (pub.)",
    ]
    out = [f"### Workload `{wf.workload}`", ""]
    out.append("Unallocated GPU % at arrived = 100% and 130%, fragmentation rate (% of idle GPU) at 90%;")
    out.append("ours: mean ± sd over seeds; published: mean ± sd over its 10 seeds. Δ = ours − published.")
    out += ["", md_table(headers, rows, right=range(1, len(headers))), ""]
    out.append(
        f"Offline references (same arrivals up to arrived = 100%, from the `{cfg.reference_policy}` runs): "
        f"first-fit-decreasing packing, knowing every pod and ignoring CPU, memory and order, leaves "
        f"**{_pm(wf.offline_ffd)}%** unallocated; no placement can leave less than "
        f"**{_pm(wf.lower_bound)}%**."
    )
    out.append("")
    for kind in ("alloc", "frag"):
        name = plots.get(f"{kind}_{wf.workload}")
        if name:
            out += [f"![{kind} {wf.workload}]({name})", ""]
    return out


def _sharing_section(sharing: dict[str, Any]) -> list[str]:
    keys = (
        ("pods_arrived", "pods arrived (to 130%)"),
        ("pods_placed_at_100", "pods placed by arrived = 100%"),
        ("capacity_serving_requests_pct_at_100", "capacity serving requests at 100%, %"),
        ("pods_placed", "pods placed by 130%"),
        ("pods_failed", "pods failed by 130%"),
        ("capacity_serving_requests_pct", "capacity serving requests at 130%, %"),
        ("allocated_gpu_milli", "GPU milli held"),
        ("idle_gpus", "idle GPUs at the end"),
    )
    s, p = sharing["static"], sharing["pooled"]
    rows = [[label, fmt(s[k]), fmt(p[k])] for k, label in keys]
    return [
        "## 2. Static vs pooled on the fill-up protocol",
        "",
        f"Workload `{SHARING_WORKLOAD}`, seed {SHARING_SEED}, same pods in the same order. "
        "`static` rounds every "
        "GPU request up to whole devices that are never shared (allocation without a pool); `pooled` "
        "places the fractional requests as asked, with the pool's `default` policy. \"Capacity serving "
        'requests" counts the GPU milli the placed pods asked for, not what static reserves for them.',
        "",
        md_table(["figure", "static", "pooled"], rows, right=(1, 2)),
        "",
    ]


def _overall_rows(items: Sequence[tuple[str, dict[str, Any]]]) -> list[list[str]]:
    rows = []
    for label, d in items:
        rows.append(
            [
                label,
                fmt(d["nodes"]),
                fmt(d["avg_queue_s"]),
                fmt(d["p50_queue_s"]),
                fmt(d["p99_queue_s"]),
                fmt(d["avg_jct_s"]),
                fmt(d["gpu_alloc_pct"]),
                fmt(d["preemptions"]),
                fmt(d["lost_work_pct"]),
            ]
        )
    return rows


_OVERALL_HEADERS = (
    "run",
    "nodes",
    "avg queue s",
    "p50 queue s",
    "p99 queue s",
    "avg JCT s",
    "GPU alloc %",
    "preemptions",
    "lost work %",
)


def _philly_section(ph: dict[str, Any], plots: dict[str, str]) -> list[str]:
    cal = ph["calibration"]
    scale = cal["duration_scale"]
    par = ph["parity"]
    pub_all = ph["published"].get("all")
    out = [
        "## 3. Philly replay: static VC partitions vs one pooled cluster",
        "",
        f"{ph['jobs']:,} jobs of the {len(ph['vcs'])} VCs, 2017-10-01 to 2017-11-30, on "
        f"{sum(v['gpus'] for v in ph['vcs']):,} GPUs. Static: each VC on its own nodes, FIFO. Pooled: one "
        "cluster, each VC guaranteed its static size, idle GPUs lent out and reclaimed by preemption.",
        "",
        "### At the trace's own load (durations x1)",
        "",
        md_table(
            _OVERALL_HEADERS,
            _overall_rows([("static FIFO", ph["scale_1"]["static"]), ("pooled", ph["scale_1"]["pooled"])]),
            right=range(1, len(_OVERALL_HEADERS)),
        ),
        "",
        f"At this load static FIFO queues {fmt(ph['scale_1']['static']['avg_queue_s'])} s on average against "
        f"the published {fmt(cal['target_avg_queue_s'])} s, which came from another conversion of the raw "
        "trace. So the durations are scaled until static FIFO's overall average matches the published one: "
        "a calibration of the load, not a reproduction of the published simulator.",
        "",
        f"### Calibrated load (durations x{scale:.4f}, {cal['iterations']} static runs to match "
        f"{fmt(cal['target_avg_queue_s'])} s)",
        "",
        md_table(
            _OVERALL_HEADERS,
            _overall_rows(
                [("static FIFO", ph["calibrated"]["static"]), ("pooled", ph["calibrated"]["pooled"])]
            ),
            right=range(1, len(_OVERALL_HEADERS)),
        ),
        "",
    ]
    if pub_all:
        out += [
            f"Published static FIFO over all VCs: average queueing {fmt(pub_all['queue_avg_s'])} s, "
            f"average JCT {fmt(pub_all['jct_avg_s'])} s.",
            "",
        ]
    headers = [
        "VC",
        "static queue s",
        "published static queue s",
        "pooled queue s",
        "static JCT s",
        "published static JCT s",
        "pooled JCT s",
        "pooled",
    ]
    rows = [
        [
            d["partition"],
            fmt(d["static_avg_queue_s"]),
            fmt(d["published_queue_s"]),
            fmt(d["pooled_avg_queue_s"]),
            fmt(d["static_avg_jct_s"]),
            fmt(d["published_jct_s"]),
            fmt(d["pooled_avg_jct_s"]),
            d["verdict"],
        ]
        for d in ph["calibrated_per_vc"]
    ]
    close = sum(
        1
        for d in ph["calibrated_per_vc"]
        if d["published_queue_s"] is not None
        and math.isfinite(d["published_queue_s"])
        and d["published_queue_s"] / 2 <= d["static_avg_queue_s"] <= d["published_queue_s"] * 2
    )
    out += [
        "Per VC at the calibrated load:",
        "",
        md_table(headers, rows, right=range(1, 7)),
        "",
        f"Only the overall average is calibrated: {close} of {len(ph['calibrated_per_vc'])} VCs' static "
        "queueing lands within a factor of 2 of its published figure, so per-VC static figures here are "
        "this simulator's, not the paper's.",
        "",
    ]
    if "queue_cdf" in plots:
        out += [f"![queueing delay CDF]({plots['queue_cdf']})", ""]
    out += ["### Parity: the smallest pooled cluster as good as static on average", ""]
    if par["nodes"] is None:
        out += ["Even a pooled cluster of static's size does not match static's average queueing.", ""]
        return out
    pooled = par["pooled"]
    out += [
        f"{par['nodes']} nodes ({par['nodes'] * 8:,} GPUs) instead of {par['static_nodes']} "
        f"({par['static_nodes'] * 8:,}): **{par['gpus_saved_pct']:.1f}% fewer GPUs** for an average queueing "
        f"delay of {fmt(pooled['avg_queue_s'])} s against static's {fmt(par['static']['avg_queue_s'])} s; "
        f"{fmt(pooled['preemptions'])} preemptions, lost work {fmt(pooled['lost_work_pct'])}% "
        "of useful GPU time. "
        f"Search probes (nodes: avg queue s): "
        + ", ".join(f"{p['nodes']}: {fmt(p['avg_queue_s'])}" for p in par["probes"])
        + ".",
        "",
    ]
    gains = [d["partition"] for d in par["per_vc"] if d["verdict"] == "gains"]
    loses = [d["partition"] for d in par["per_vc"] if d["verdict"] == "loses"]
    rows = [
        [
            d["partition"],
            fmt(d["static_avg_queue_s"]),
            fmt(d["pooled_avg_queue_s"]),
            fmt(d["static_avg_jct_s"]),
            fmt(d["pooled_avg_jct_s"]),
            d["verdict"],
        ]
        for d in par["per_vc"]
    ]
    out += [
        md_table(
            ["VC", "static queue s", "pooled queue s", "static JCT s", "pooled JCT s", "pooled"],
            rows,
            right=range(1, 5),
        ),
        "",
        f"At parity {len(gains)} VC(s) gain ({', '.join(gains) or 'none'}) and {len(loses)} lose "
        f"({', '.join(loses) or 'none'}) against their own static partition: parity holds for the "
        "average over all jobs, not for every VC.",
        "",
    ]
    return out


def render_markdown(
    cfg: ReportConfig,
    figs: dict[str, WorkloadFigures],
    summary: list[SummaryRow],
    sharing: dict[str, Any] | None,
    philly: dict[str, Any] | None,
    plots: dict[str, str],
    elapsed_s: float,
    cpu_s: float,
) -> str:
    seeds = ", ".join(str(s) for s in cfg.seeds)
    out = [
        "# ComputePool simulation report",
        "",
        f"Generated {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')} in {elapsed_s:,.0f} s wall "
        f"({cpu_s:,.0f} s of runs, {cfg.jobs} worker process(es)). Traces: `{cfg.traces}`.",
        "",
        f"- Workloads: {', '.join(cfg.workloads)}",
        f"- Policies: {', '.join(cfg.policies)}",
        f"- Seeds: {seeds} (tune {cfg.tune})",
        f"- Philly replay: {'yes' if philly is not None else 'skipped (--no-replay)'}",
        "",
        "Raw figures of every run are in `results.json`.",
        "",
        "## Summary: unallocated GPU % at arrived = 100% (lower is better)",
        "",
        f"Ours: mean over {len(cfg.seeds)} seed(s); published: the FGD paper's mean over 10 seeds. "
        "The checks: "
        f"our bestfit and fgd within {MATCH_PTS} points of the published figure, and the pool's `default` "
        f"policy (no knowledge of future requests) no worse than published fgd + {DEFAULT_MARGIN_PTS}. "
        "Offline FFD and the lower bound are references, not policies (see the per-workload notes).",
        "",
        md_table(SUMMARY_HEADERS, [summary_cells(r) for r in summary], right=range(1, 8)),
        "",
        "## 1. Fill-up reproduction (Alibaba GPU trace 2023)",
        "",
        "Pods arrive in a seeded random order, inflated to 130% of GPU capacity, never leave, and fail if no "
        "node fits (`cpool sim fill`). Our seeds' shuffles differ from the published Go simulator's, so "
        "means over seeds are compared, not single runs. `fgd` uses the workload's typical pods from the "
        "whole trace (future knowledge) as published; `default` learns them online.",
        "",
    ]
    for wf in figs.values():
        out += _workload_section(wf, cfg, plots)
    if sharing is not None:
        out += _sharing_section(sharing)
    if philly is not None:
        out += _philly_section(philly, plots)
    return "\n".join(out).rstrip() + "\n"


# -- driver ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    """What `build_report` wrote, and the headline for the terminal."""

    out: Path
    markdown: Path
    results: Path
    plots: tuple[Path, ...]
    summary: tuple[SummaryRow, ...]
    philly: dict[str, Any] | None
    elapsed_s: float


def jsonable(o: Any) -> Any:
    """Plain JSON values: numpy to Python, NaN and infinities to null."""
    if isinstance(o, dict):
        return {str(k): jsonable(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [jsonable(v) for v in o]
    if isinstance(o, np.ndarray):
        return jsonable(o.tolist())
    if isinstance(o, np.generic):
        return jsonable(o.item())
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, Path):
        return str(o)
    return o


def fill_tasks(cfg: ReportConfig) -> list[FillTask]:
    ref = cfg.reference_policy
    return [
        FillTask(w, p, s, p == ref, cfg.tune, str(cfg.traces))
        for w in cfg.workloads
        for p in cfg.policies
        for s in cfg.seeds
    ]


def _results_json(
    cfg: ReportConfig,
    runs: list[dict[str, Any]],
    figs: dict[str, WorkloadFigures],
    summary: list[SummaryRow],
    sharing: dict[str, Any] | None,
    philly: PhillyOutcome | None,
    elapsed_s: float,
    cpu_s: float,
) -> dict[str, Any]:
    per_policy = []
    for wf in figs.values():
        for pf in wf.policies.values():
            pp = pf.published
            per_policy.append(
                {
                    "workload": pf.workload,
                    "policy": pf.policy,
                    "unallocated_pct_at_100": asdict(pf.unalloc_100),
                    "unallocated_pct_at_130": asdict(pf.unalloc_130),
                    "frag_rate_pct_at_90": asdict(pf.frag_rate_90),
                    "delta_at_100": pf.delta_100,
                    "mean_alloc_curve": pf.alloc_curve,
                    "mean_frag_rate_curve": pf.frag_rate_curve,
                    "published": None
                    if pp is None
                    else {
                        "n_seeds": pp.n_seeds,
                        "unallocated_pct_at_100": pp.unalloc_100,
                        "alloc_pct_at_100_sd": pp.alloc_100_sd,
                        "unallocated_pct_at_130": pp.unalloc_130,
                        "frag_rate_pct_at_90": pp.frag_rate_90,
                        "mean_alloc_curve": pp.alloc_curve,
                        "mean_frag_rate_curve": pp.frag_rate_curve,
                    },
                }
            )
    philly_out: dict[str, Any] | None = None
    if philly is not None:
        pct = np.arange(101)
        philly_out = {
            **philly.figures,
            "queue_delay_percentiles_s": {
                "percent": pct,
                **{k: np.percentile(v, pct) if v.size else [] for k, v in philly.delays.items()},
            },
        }
    return jsonable(
        {
            "config": {
                "seeds": cfg.seeds,
                "workloads": cfg.workloads,
                "policies": cfg.policies,
                "jobs": cfg.jobs,
                "replay": cfg.replay,
                "tune": cfg.tune,
                "traces": cfg.traces,
                "reference_policy": cfg.reference_policy,
                "match_pts": MATCH_PTS,
                "default_margin_pts": DEFAULT_MARGIN_PTS,
            },
            "elapsed_s": round(elapsed_s, 2),
            "cpu_s_of_runs": round(cpu_s, 2),
            "summary": [r.as_dict() for r in summary],
            "fill": {"per_policy": per_policy, "runs": runs},
            "static_vs_pooled": None
            if sharing is None
            else {"workload": SHARING_WORKLOAD, "seed": SHARING_SEED, **sharing},
            "philly": philly_out,
        }
    )


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


def build_report(cfg: ReportConfig, progress: Progress | None = None) -> Report:
    """Run every study in `cfg.jobs` processes, then write report.md, the plots and results.json."""
    t0 = time.perf_counter()
    tasks = fill_tasks(cfg)
    total = len(tasks) + 1 + (1 if cfg.replay else 0)
    runs: list[dict[str, Any]] = []
    sharing: dict[str, Any] | None = None
    philly: PhillyOutcome | None = None
    cpu_s = 0.0
    done = 0
    if progress is not None:
        progress(0, total)
    # spawn, not fork: the parent may run a progress-bar thread, and forking a threaded process
    # can copy a held lock into the child.
    ctx = multiprocessing.get_context("spawn")
    ex = ProcessPoolExecutor(max_workers=cfg.jobs, mp_context=ctx)
    try:
        futures: dict[Future[Any], str] = {}
        if cfg.replay:  # longest first, so it overlaps the fill runs
            futures[ex.submit(_timed, run_philly_task, str(cfg.traces))] = "philly"
        futures[
            ex.submit(_timed, run_sharing_task, str(cfg.traces), SHARING_WORKLOAD, SHARING_SEED, cfg.tune)
        ] = "sharing"
        for t in tasks:
            futures[ex.submit(_timed, run_fill_task, t)] = "fill"
        for fut in as_completed(futures):
            value, spent = fut.result()
            cpu_s += spent
            kind = futures[fut]
            if kind == "fill":
                runs.append(value)
            elif kind == "sharing":
                sharing = value
            else:
                philly = value
            done += 1
            if progress is not None:
                progress(done, total)
    except BaseException:
        ex.shutdown(wait=False, cancel_futures=True)
        raise
    ex.shutdown()
    order = {(t.workload, t.policy, t.seed): i for i, t in enumerate(tasks)}
    runs.sort(key=lambda r: order[(r["workload"], r["policy"], r["seed"])])

    published = load_published_fgd(cfg.traces / PUBLISHED_DIR)
    figs = aggregate(runs, cfg.workloads, cfg.policies, published)
    summary = summarise(figs, published)
    out = cfg.out
    plots: dict[str, str] = {}
    paths: list[Path] = []
    for w, wf in figs.items():
        for kind, fn in (("alloc", plot_alloc), ("frag", plot_frag)):
            p = fn(wf, out / f"{kind}_{w}.png", len(cfg.seeds))
            plots[f"{kind}_{w}"] = p.name
            paths.append(p)
    if philly is not None:
        p = plot_queue_cdf(
            philly.delays, out / "queue_cdf.png", philly.figures["calibration"]["duration_scale"]
        )
        plots["queue_cdf"] = p.name
        paths.append(p)
    elapsed = time.perf_counter() - t0
    md = render_markdown(
        cfg, figs, summary, sharing, philly.figures if philly else None, plots, elapsed, cpu_s
    )
    md_path = out / "report.md"
    md_path.write_text(md, encoding="utf-8")
    res_path = out / "results.json"
    data = _results_json(cfg, runs, figs, summary, sharing, philly, elapsed, cpu_s)
    tmp = res_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, res_path)
    return Report(
        out=out,
        markdown=md_path,
        results=res_path,
        plots=tuple(paths),
        summary=tuple(summary),
        philly=philly.figures if philly else None,
        elapsed_s=elapsed,
    )
