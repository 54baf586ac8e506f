"""One `cpool sim hetero` run: load Gavel's files, shape the load, replay under each policy."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from computepool.sim.gavel import THROUGHPUTS_FILE, load_throughputs, load_trace, parse_cluster
from computepool.sim.hetero import ROUND_S, build_jobs, retime, run_agnostic, run_aware

POLICY_CHOICES = ("agnostic", "aware", "fair", "both", "all")


@dataclass(frozen=True)
class HeteroSpec:
    trace: Path
    cluster: str = "36:36:36"
    throughputs: Path | None = None  # default: the Gavel file beside the trace (or one folder up)
    policy: str = "both"
    jobs: int | None = None  # the first N jobs by arrival
    rate_per_h: float | None = None  # re-time arrivals as a Poisson stream
    sample: int | None = None  # with a rate: this many jobs drawn from the trace with replacement
    window: str | None = None  # "A:B": JCT figures over jobs A..B-1 (by arrival) only
    seed: int = 0
    gpus_per_node: int = 8
    round_s: float = ROUND_S
    restart_s: float = 10.0

    def check(self) -> None:
        if self.policy not in POLICY_CHOICES:
            raise ValueError(f"--policy {self.policy!r}: choose from {', '.join(POLICY_CHOICES)}")
        if self.jobs is not None and self.jobs < 1:
            raise ValueError(f"--jobs {self.jobs}: must be at least 1")
        if self.rate_per_h is not None and not (math.isfinite(self.rate_per_h) and self.rate_per_h > 0):
            raise ValueError(f"--rate {self.rate_per_h}: must be a positive number of jobs an hour")
        if self.sample is not None and (self.sample < 1 or self.rate_per_h is None):
            raise ValueError(f"--sample {self.sample}: needs --rate and at least 1 job")
        if self.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node {self.gpus_per_node}: must be at least 1")
        if not (math.isfinite(self.round_s) and self.round_s > 0):
            raise ValueError(f"--round-s {self.round_s}: must be positive")
        if not (math.isfinite(self.restart_s) and 0 <= self.restart_s < self.round_s):
            raise ValueError(f"--restart-s {self.restart_s}: must be at least 0 and below the round")

    def throughputs_path(self) -> Path:
        if self.throughputs is not None:
            return self.throughputs
        for folder in (self.trace.parent, self.trace.parent.parent):
            if (folder / THROUGHPUTS_FILE).is_file():
                return folder / THROUGHPUTS_FILE
        raise ValueError(
            f"{self.trace}: no {THROUGHPUTS_FILE} beside it or one folder up; pass --throughputs"
        )


def run(spec: HeteroSpec) -> dict[str, object]:
    """Both policies (or one) on the same jobs; JCT figures in seconds."""
    spec.check()
    capacity = parse_cluster(spec.cluster)
    speeds = load_throughputs(spec.throughputs_path())
    trace = load_trace(spec.trace)
    jobs, dropped = build_jobs(trace, str(spec.trace), speeds, capacity, spec.gpus_per_node)
    if spec.jobs is not None:
        jobs = jobs[: spec.jobs]
    if not jobs:
        raise ValueError(f"{spec.trace}: no job fits the cluster {spec.cluster}")
    if spec.rate_per_h is not None:
        jobs = retime(jobs, spec.rate_per_h, spec.seed, spec.sample)
    lo, hi = _window(spec.window, len(jobs))
    out: dict[str, object] = {
        "trace": str(spec.trace),
        "cluster": {**capacity, "gpus_per_node": spec.gpus_per_node},
        "jobs": len(jobs),
        "jobs_too_wide": dropped,
        "jobs_speed_scaled": sum(not j.measured for j in jobs),
        "rate_per_h": spec.rate_per_h,
        "sampled": spec.sample is not None,
        "window": [lo, hi],
        "seed": spec.seed if spec.rate_per_h is not None else None,
        "round_s": spec.round_s,
        "restart_s": spec.restart_s,
    }
    res: dict[str, float] = {}
    if spec.policy in ("agnostic", "both", "all"):
        a = run_agnostic(jobs, capacity, spec.gpus_per_node, spec.restart_s)
        a = a.over(jobs[lo:hi])
        out["agnostic"] = a.as_dict()
        res["agnostic"] = a.avg_jct_s
    if spec.policy in ("aware", "both", "all"):
        w = run_aware(jobs, capacity, spec.gpus_per_node, spec.restart_s, spec.round_s)
        w = w.over(jobs[lo:hi])
        out["aware"] = w.as_dict()
        res["aware"] = w.avg_jct_s
    if spec.policy in ("fair", "all"):
        f = run_aware(jobs, capacity, spec.gpus_per_node, spec.restart_s, spec.round_s, blind=True)
        out["fair"] = f.over(jobs[lo:hi]).as_dict()
    if "agnostic" in res and "aware" in res:
        out["avg_jct_ratio"] = round(res["agnostic"] / res["aware"], 3) if res["aware"] > 0 else None
    return out


def _window(text: str | None, n: int) -> tuple[int, int]:
    if text is None:
        return 0, n
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--window {text!r}: expected A:B, job indices by arrival") from None
    if not 0 <= lo < hi <= n:
        raise ValueError(f"--window {text!r}: needs 0 <= A < B <= {n} (the jobs replayed)")
    return lo, hi
