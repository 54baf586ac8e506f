"""Gavel's heterogeneous-cluster data: measured throughputs, job traces and cluster sizes.

The files are those of Gavel's public repository (under `$CPOOL_TRACES/gavel`, README there):

- `simulation_throughputs.json`: `gpu_type → "('<job type>', scale_factor)" → other_job | "null" →
  steps/s`. Only the job alone (`"null"`) is read; co-location pairs are ignored.
- `*.trace`, one job a line, tab-separated. Two layouts occur: the Philly-derived traces
  (`msr-seed0/`) have 7 fields (job type, command, steps argument, needs-data flag, total steps,
  arrival s, scale factor); the physical-cluster traces have 10 (job type, command, working
  directory, steps argument, needs-data flag, total steps, scale factor, priority weight, SLO,
  arrival s).
- `cluster_specs*.json`: `{"<name>": ["v100:p100:k80", ...]}`.

Every error names the file and, for a trace, the line.
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass
from pathlib import Path

from computepool.scheduler.hetero import GPU_TYPES, Speeds

THROUGHPUTS_FILE = "simulation_throughputs.json"


class GavelDataError(ValueError):
    """Bad or missing input, with the file (and line) it came from."""


@dataclass(frozen=True)
class TraceJob:
    """One trace line: what runs, how long (in steps) and on how many GPUs of one type."""

    line: int  # 1-based line in the trace file
    job_type: str
    total_steps: int
    arrival_s: float
    scale_factor: int
    priority: float = 1.0


def load_throughputs(path: Path) -> Speeds:
    """Steps/s of every (job type, scale factor) alone on each GPU type the file has."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise GavelDataError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GavelDataError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise GavelDataError(f"{path}: expected an object of GPU types at the top")
    rates: dict[tuple[str, int], dict[str, float]] = {}
    found = [g for g in GPU_TYPES if g in raw]
    if not found:
        raise GavelDataError(f"{path}: none of the GPU types {', '.join(GPU_TYPES)} at the top")
    for gpu in found:
        table = raw[gpu]
        if not isinstance(table, dict):
            raise GavelDataError(f"{path}: {gpu}: expected an object of job types")
        for key, others in table.items():
            job_type, scale = _job_key(path, gpu, key)
            alone = others.get("null") if isinstance(others, dict) else None
            if not isinstance(alone, int | float) or isinstance(alone, bool) or not math.isfinite(alone):
                raise GavelDataError(f'{path}: {gpu} {key}: no numeric throughput under "null"')
            if alone < 0:
                raise GavelDataError(f"{path}: {gpu} {key}: negative throughput {alone}")
            rates.setdefault((job_type, scale), {})[gpu] = float(alone)
    return Speeds(rates)


def _job_key(path: Path, gpu: str, key: str) -> tuple[str, int]:
    try:
        val = ast.literal_eval(key)
    except (ValueError, SyntaxError):
        val = None
    if not (isinstance(val, tuple) and len(val) == 2 and isinstance(val[0], str) and isinstance(val[1], int)):
        raise GavelDataError(f"{path}: {gpu}: bad job key {key!r} (expected \"('<job type>', <gpus>)\")")
    return val[0], val[1]


def load_trace(path: Path) -> list[TraceJob]:
    """The trace's jobs in file order (7- or 10-field lines; blank lines skipped)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise GavelDataError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise GavelDataError(f"{path}: not readable ({e})") from None
    jobs: list[TraceJob] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        f = line.split("\t")
        if len(f) == 7:
            steps, arrival, scale, prio = f[4], f[5], f[6], "1"
        elif len(f) == 10:
            steps, scale, prio, arrival = f[5], f[6], f[7], f[9]
        else:
            raise GavelDataError(f"{path}:{n}: {len(f)} tab-separated fields, expected 7 or 10")
        where = f"{path}:{n}"
        jobs.append(
            TraceJob(
                line=n,
                job_type=f[0].strip() or _fail(where, "empty job type"),
                total_steps=_int(where, "total steps", steps),
                arrival_s=_float(where, "arrival time", arrival),
                scale_factor=_int(where, "scale factor", scale),
                priority=_float(where, "priority weight", prio, positive=True),
            )
        )
    if not jobs:
        raise GavelDataError(f"{path}: no jobs")
    return jobs


def _fail(where: str, what: str) -> str:
    raise GavelDataError(f"{where}: {what}")


def _int(where: str, what: str, text: str) -> int:
    try:
        v = int(text.strip())
    except ValueError:
        raise GavelDataError(f"{where}: {what} {text!r} is not a whole number") from None
    if v < 1:
        raise GavelDataError(f"{where}: {what} {v} must be at least 1")
    return v


def _float(where: str, what: str, text: str, *, positive: bool = False) -> float:
    try:
        v = float(text.strip())
    except ValueError:
        raise GavelDataError(f"{where}: {what} {text!r} is not a number") from None
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise GavelDataError(f"{where}: {what} {v} must be {'positive' if positive else 'at least 0'}")
    return v


def parse_cluster(text: str) -> dict[str, int]:
    """`"36:36:36"` (V100:P100:K80 counts, Gavel's order) → {"v100": 36, "p100": 36, "k80": 36}."""
    parts = text.split(":")
    if len(parts) != 3:
        raise ValueError(f"--cluster {text!r}: expected V:P:K, the counts of V100, P100 and K80 GPUs")
    out: dict[str, int] = {}
    for gpu, p in zip(("v100", "p100", "k80"), parts, strict=True):
        try:
            n = int(p)
        except ValueError:
            raise ValueError(f"--cluster {text!r}: {p!r} is not a whole number") from None
        if n < 0:
            raise ValueError(f"--cluster {text!r}: a count is negative")
        out[gpu] = n
    if sum(out.values()) == 0:
        raise ValueError(f"--cluster {text!r}: no GPUs")
    return out
