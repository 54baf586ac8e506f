"""Running the report's studies in worker processes.

The task functions are top level so they can be pickled; `run_all` submits them to a spawn
pool and collects every raw result.
"""

from __future__ import annotations

import math
import multiprocessing
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from computepool.core.errors import InvalidInput
from computepool.core.resources import Node
from computepool.sim.alibaba import Pod, load_nodes, load_pods
from computepool.sim.energy import compare_replays
from computepool.sim.fill import run_fill
from computepool.sim.philly import ASSUMED_GPU_MODEL, JobTrace, load_trace
from computepool.sim.prices import Prices
from computepool.sim.published import helios_target_avg_queue_s, load_published_helios
from computepool.sim.replay import (
    CRITERION,
    FairParity,
    ReplayResult,
    VcComparison,
    calibrate,
    compare,
    find_fair_parity,
    find_parity,
    replay,
    verdicts,
)
from computepool.sim.report_config import (
    ALIBABA_DIR,
    NODE_LIST,
    PHILLY_DIR,
    POD_PREFIX,
    SHARING_SEED,
    SHARING_WORKLOAD,
    ReportConfig,
)
from computepool.sim.sharing import static_vs_pooled

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class FillTask:
    workload: str
    policy: str
    seed: int
    offline: bool
    tune: float
    traces: str


def _load_alibaba(traces: str, workload: str) -> tuple[list[Node], list[Pod]]:
    """The node list and one workload's pods of the Alibaba trace under `traces`."""
    base = Path(traces) / ALIBABA_DIR
    try:
        return load_nodes(base / NODE_LIST), load_pods(base / f"{POD_PREFIX}{workload}.csv")
    except InvalidInput as e:  # its two-argument constructor does not survive pickling
        raise ValueError(str(e)) from None


def run_fill_task(task: FillTask) -> dict[str, Any]:
    """One fill-up run; the raw result (curves included) as a plain dict."""
    nodes, pods = _load_alibaba(task.traces, task.workload)
    res = run_fill(
        nodes, pods, task.policy, task.seed, tune=task.tune, workload=task.workload, offline=task.offline
    )
    return dict(res.__dict__)


def run_sharing_task(traces: str, workload: str, seed: int, tune: float) -> dict[str, Any]:
    """Static whole-device allocation vs the pool, on the fill-up protocol."""
    nodes, pods = _load_alibaba(traces, workload)
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
        pubs = load_published_helios(Path(traces))
    except InvalidInput as e:
        raise ValueError(str(e)) from None
    target = helios_target_avg_queue_s(pubs)
    t0 = time.perf_counter()
    s1, p1 = replay(trace, "static", 1.0), replay(trace, "pooled", 1.0)
    cal = calibrate(trace, target)
    scale = cal.duration_scale
    static = cal.result
    pooled = replay(trace, "pooled", scale)
    parity = find_parity(trace, scale, static=static)
    fair = find_fair_parity(trace, scale, "guaranteed-share", static=static)
    fair_proportional = find_fair_parity(trace, scale, "proportional", static=static)

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
        "fair_parity": _fair_figures(fair, fair_proportional, trace, scale),
        "energy": _philly_energy(static, parity.pooled, fair.pooled),
        "elapsed_s": round(time.perf_counter() - t0, 2),
    }
    delays = {"static": _delays(trace, static), "pooled": _delays(trace, pooled)}
    if parity.pooled is not None and parity.nodes is not None:
        delays[f"pooled, {parity.nodes} nodes (parity)"] = _delays(trace, parity.pooled)
    return PhillyOutcome(figures, delays)


def _fair_figures(
    fair: FairParity, proportional: FairParity, trace: JobTrace, scale: float
) -> dict[str, Any]:
    """Guaranteed-share at its every-VC parity, and proportional guarantees by the same test."""
    out: dict[str, Any] = {
        "criterion": CRITERION,
        "policy": fair.policy,
        "nodes": fair.nodes,
        "static_nodes": fair.static.nodes,
        "gpus_saved_pct": fair.gpus_saved_pct,
        "probes": [{"nodes": n, "vcs_worse_off": w} for n, w in fair.probes],
        "pooled": _overall(fair.pooled) if fair.pooled is not None else None,
        "per_vc": [v.as_dict() for v in fair.per_vc()],
        "proportional_nodes": proportional.nodes,
        "proportional_gpus_saved_pct": proportional.gpus_saved_pct,
        "proportional_probes": [{"nodes": n, "vcs_worse_off": w} for n, w in proportional.probes],
    }
    if fair.nodes is not None:
        same = replay(trace, "pooled", scale, fair.nodes)
        out["proportional_at_same_nodes_worse_off"] = [
            v.partition for v in verdicts(fair.static, same) if v.worse
        ]
    return out


def _philly_energy(
    static: ReplayResult, parity: ReplayResult | None, fair: ReplayResult | None
) -> dict[str, Any]:
    """Energy and cost of static, the average parity and the every-VC parity, over one horizon."""
    runs = {"static": static}
    if parity is not None:
        runs[f"proportional, {parity.nodes} nodes"] = parity
    if fair is not None:
        runs[f"guaranteed-share, {fair.nodes} nodes"] = fair
    return compare_replays(runs, ASSUMED_GPU_MODEL, Prices())


def fill_tasks(cfg: ReportConfig) -> list[FillTask]:
    """Every workload x policy x seed, in report order; the reference policy's runs go offline too."""
    ref = cfg.reference_policy
    return [
        FillTask(w, p, s, p == ref, cfg.tune, str(cfg.traces))
        for w in cfg.workloads
        for p in cfg.policies
        for s in cfg.seeds
    ]


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


@dataclass(frozen=True)
class RunOutcome:
    """Every raw result: fill runs in `fill_tasks` order, static vs pooled, and the Philly replay."""

    runs: list[dict[str, Any]]
    sharing: dict[str, Any] | None
    philly: PhillyOutcome | None
    cpu_s: float  # summed wall time of the tasks in the workers


def run_all(cfg: ReportConfig, progress: Progress | None = None) -> RunOutcome:
    """Run every study in `cfg.jobs` processes, reporting (done, total) to `progress`."""
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
    return RunOutcome(runs, sharing, philly, cpu_s)
