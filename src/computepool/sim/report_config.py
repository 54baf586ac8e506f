"""What `cpool sim report` runs: the trace layout, the defaults, and the validated `ReportConfig`."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from computepool.core.errors import InvalidInput
from computepool.scheduler.policy_names import POLICIES
from computepool.sim.csvread import traces_dir

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
