"""Load the Microsoft Philly 2017 trace: jobs, virtual-cluster (VC) sizes, published figures.

The published static-partition figures (Helios SC'21) cover only the 11 VCs of
`philly_vc.csv` and jobs submitted from 2017-10-01 up to 2017-12-01, so the loader keeps
exactly that slice. Rows are validated (every malformed row raises `InvalidInput` naming
`FILE:LINE`) and returned as numpy arrays sorted by submit time, so the simulator never
touches Python objects per job.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import NoReturn

import numpy as np

from computepool.core.errors import InvalidInput
from computepool.sim.csvread import traces_dir

GPUS_PER_NODE = 8
WINDOW_START = datetime(2017, 10, 1)
WINDOW_END = datetime(2017, 12, 1)
JOB_COLUMNS = ("timestamp", "duration", "num_gpus", "gpu_time", "cluster")
VC_COLUMNS = ("vc", "node num")
PUBLISHED_COLUMNS = ("metric", "vc", "fifo")
PUBLISHED_AVG_QUEUE_S = 56_531.0
PUBLISHED_AVG_JCT_S = 86_072.0
# The trace does not name its GPUs; Philly ran P100- and P40-class boards, and the energy
# figures assume P100 (a replay option changes it).
ASSUMED_GPU_MODEL = "P100"


@dataclass(frozen=True)
class VirtualCluster:
    """A tenant's static partition: `nodes` whole 8-GPU nodes."""

    name: str
    nodes: int

    @property
    def gpus(self) -> int:
        return self.nodes * GPUS_PER_NODE


@dataclass(frozen=True)
class Published:
    """Published static-partition FIFO figures of one VC (or of `all`)."""

    vc: str
    queue_avg_s: float
    jct_avg_s: float


@dataclass(frozen=True)
class JobTrace:
    """Jobs as parallel arrays sorted by submit time (seconds from `origin`).

    `vc` indexes `vcs`. Arrays are read-only so one trace can be shared by many replays.
    """

    vcs: tuple[VirtualCluster, ...]
    submit: np.ndarray  # float64 s
    duration: np.ndarray  # float64 s
    gpus: np.ndarray  # int64
    vc: np.ndarray  # int64 index into vcs
    origin: datetime = WINDOW_START

    def __post_init__(self) -> None:
        n = len(self.submit)
        for name in ("duration", "gpus", "vc"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"JobTrace.{name} has {len(getattr(self, name))} rows, not {n}")
        for arr in (self.submit, self.duration, self.gpus, self.vc):
            arr.flags.writeable = False

    def __len__(self) -> int:
        return len(self.submit)

    @property
    def total_gpus(self) -> int:
        return sum(v.gpus for v in self.vcs)

    @property
    def total_nodes(self) -> int:
        return sum(v.nodes for v in self.vcs)

    @classmethod
    def from_jobs(
        cls,
        vcs: Sequence[VirtualCluster],
        jobs: Iterable[tuple[float, float, int, str]],
    ) -> JobTrace:
        """Build a trace from `(submit_s, duration_s, gpus, vc_name)` tuples (tests, demos)."""
        index = {v.name: i for i, v in enumerate(vcs)}
        rows = list(jobs)
        submit = np.array([r[0] for r in rows], dtype=np.float64)
        order = np.argsort(submit, kind="stable")
        return cls(
            vcs=tuple(vcs),
            submit=submit[order],
            duration=np.array([r[1] for r in rows], dtype=np.float64)[order],
            gpus=np.array([r[2] for r in rows], dtype=np.int64)[order],
            vc=np.array([index[r[3]] for r in rows], dtype=np.int64)[order],
        )


def _rows(path: Path, required: Sequence[str]) -> Iterator[tuple[int, list[str]]]:
    """Yield (line, values of `required` in that order) per non-blank row; check the header."""
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise InvalidInput(f"{path}:1", "empty file, expected a header row")
        header = [h.strip() for h in header]
        missing = [c for c in required if c not in header]
        if missing:
            raise InvalidInput(f"{path}:1", f"missing column(s) {', '.join(missing)}")
        cols = [header.index(c) for c in required]
        width = len(header)
        for row in reader:
            if len(row) != width:
                if not row:
                    continue
                raise InvalidInput(f"{path}:{reader.line_num}", f"expected {width} fields, got {len(row)}")
            yield reader.line_num, [row[i] for i in cols]


def _number(where: str, column: str, text: str, *, positive: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise InvalidInput(where, f"{column} {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        need = "positive" if positive else "non-negative"
        raise InvalidInput(where, f"{column} {text!r} must be a finite {need} number")
    return value


def _whole(where: str, column: str, text: str) -> int:
    value = _number(where, column, text, positive=True)
    if value != int(value):
        raise InvalidInput(where, f"{column} {text!r} must be a whole number")
    return int(value)


def load_vcs(path: str | os.PathLike[str]) -> tuple[VirtualCluster, ...]:
    """Read `philly_vc.csv` (`vc,node num`) in file order."""
    p = Path(path)
    out: list[VirtualCluster] = []
    seen: set[str] = set()
    for line, row in _rows(p, VC_COLUMNS):
        where = f"{p}:{line}"
        name = row[0].strip()
        if not name:
            raise InvalidInput(where, "vc is empty")
        if name in seen:
            raise InvalidInput(where, f"vc {name!r} listed twice")
        seen.add(name)
        out.append(VirtualCluster(name, _whole(where, "node num", row[1])))
    if not out:
        raise InvalidInput(f"{p}:1", "no virtual clusters listed")
    return tuple(out)


def load_jobs(
    path: str | os.PathLike[str],
    vcs: Sequence[VirtualCluster],
    start: datetime = WINDOW_START,
    end: datetime = WINDOW_END,
) -> JobTrace:
    """Read `philly_jobs.csv`, keeping jobs of `vcs` submitted in [start, end).

    Every row is validated, also those dropped by the filter: a malformed file is an error
    wherever the damage lies. Columns are parsed by numpy in one go; only when that fails are
    the rows walked one by one to name the bad line.
    """
    p = Path(path)
    lines: list[int] = []
    cols: list[list[str]] = [[] for _ in JOB_COLUMNS]
    for line, row in _rows(p, JOB_COLUMNS):
        lines.append(line)
        for c, v in zip(cols, row, strict=True):
            c.append(v)
    stamps, durs, ngpus, gpu_times, names = cols

    def first_bad(values: list[str], column: str, check: Callable[[str, str], object]) -> NoReturn:
        for line, text in zip(lines, values, strict=True):
            check(f"{p}:{line}", text)
        raise InvalidInput(f"{p}:{lines[0] if lines else 1}", f"bad {column} column")

    def ts_check(where: str, text: str) -> None:
        try:
            datetime.fromisoformat(text.strip())
        except ValueError:
            raise InvalidInput(where, f"timestamp {text!r} is not a date-time") from None

    try:
        ts = np.array(stamps, dtype="datetime64[s]")
    except ValueError:
        first_bad(stamps, "timestamp", ts_check)
    floats: dict[str, np.ndarray] = {}
    for column, values, positive, whole in (
        ("duration", durs, False, False),
        ("num_gpus", ngpus, True, True),
        ("gpu_time", gpu_times, False, False),
    ):

        def check(where: str, text: str, c: str = column, pos: bool = positive, w: bool = whole) -> None:
            if w:
                _whole(where, c, text)
            else:
                _number(where, c, text, positive=pos)

        try:
            arr = np.array(values, dtype=np.float64)
        except ValueError:
            first_bad(values, column, check)
        bad = ~np.isfinite(arr) | (arr < 0)
        if positive:
            bad |= arr == 0
        if whole:
            bad |= arr != np.floor(arr)
        if bad.any():
            i = int(np.argmax(bad))
            check(f"{p}:{lines[i]}", values[i])
        floats[column] = arr
    index = {v.name: i for i, v in enumerate(vcs)}
    vc_of = np.empty(len(names), dtype=np.int64)
    for i, name in enumerate(names):
        key = name.strip()
        if not key:
            raise InvalidInput(f"{p}:{lines[i]}", "cluster is empty")
        vc_of[i] = index.get(key, -1)
    t0, t1 = np.datetime64(start, "s"), np.datetime64(end, "s")
    keep = (vc_of >= 0) & (ts >= t0) & (ts < t1)
    submit = (ts[keep] - t0).astype(np.float64)
    order = np.argsort(submit, kind="stable")
    return JobTrace(
        vcs=tuple(vcs),
        submit=submit[order],
        duration=floats["duration"][keep][order],
        gpus=floats["num_gpus"][keep][order].astype(np.int64),
        vc=vc_of[keep][order],
        origin=start,
    )


def load_published(path: str | os.PathLike[str]) -> dict[str, Published]:
    """Read the FIFO column of `helios_static_vc_published.csv` (metrics que_avg, jct_avg)."""
    p = Path(path)
    queue: dict[str, float] = {}
    jct: dict[str, float] = {}
    for line, (metric, vc, fifo) in _rows(p, PUBLISHED_COLUMNS):
        where = f"{p}:{line}"
        if metric == "que_avg":
            queue[vc] = _number(where, "fifo", fifo)
        elif metric == "jct_avg":
            jct[vc] = _number(where, "fifo", fifo)
    return {vc: Published(vc, queue[vc], jct.get(vc, math.nan)) for vc in queue}


def load_trace(
    jobs: str | os.PathLike[str] | None = None, partitions: str | os.PathLike[str] | None = None
) -> JobTrace:
    """Load the Philly window used by the published figures (default paths from `traces_dir`)."""
    base = traces_dir() / "philly"
    vcs = load_vcs(partitions if partitions is not None else base / "philly_vc.csv")
    return load_jobs(jobs if jobs is not None else base / "philly_jobs.csv", vcs)
