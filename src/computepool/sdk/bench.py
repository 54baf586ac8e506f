"""`cpool bench functions`: what a remote call costs on a live pool.

- warm: sequential `.remote()` of a no-op on one worker kept warm (the call path alone);
- cold: sequential `.remote()` with keep_warm=0, so each call starts a new worker allocation and
  process (no pip): scheduling, the agent's start, Python's start, unpacking the code; each on an
  idle pool (the previous call's worker has ended);
- map: `.map()` over no-op inputs with `workers` warm workers (submission and result batching).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from computepool.client.bench import percentile
from computepool.sdk.pool import Pool, RemoteFunction

_WORK_SOURCE = """\
def work(x=None, pause=0):
    if pause:
        import time
        time.sleep(pause)
    return x
"""


def _main_function(source: str, name: str) -> Callable[..., Any]:
    """A function of `__main__`, so that it travels by value (the node has no computepool)."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(source, f"<cpool bench {name}>", "exec"), namespace)  # noqa: S102 - our own constant
    fn: Callable[..., Any] = namespace[name]
    return fn


@dataclass(frozen=True)
class FunctionsBench:
    warm_calls: int = 200
    cold_calls: int = 10
    map_calls: int = 1000
    workers: int = 8
    cpus: str = "0.1"


def _ms(values: list[float], q: float) -> float:
    value = percentile([v * 1000 for v in values], q)
    return round(value, 2) if value is not None else 0.0


def _idle(pool: Pool, fn: RemoteFunction[Any, Any], timeout_s: float = 30.0) -> None:
    """Until none of the function's workers is live: a cold call then starts on an idle pool."""
    deadline = time.monotonic() + timeout_s
    while pool.client.request("GET", f"/functions/{fn.register()}")["workers_live"] > 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{fn.name}: workers still live after {timeout_s:g} s")
        time.sleep(0.1)


def _timed(fn: RemoteFunction[Any, Any], count: int, idle: Pool | None = None) -> list[float]:
    out = []
    for i in range(count):
        if idle is not None:
            _idle(idle, fn)
        t0 = time.perf_counter()
        if fn.remote(i) != i:
            raise RuntimeError(f"{fn.name}: call {i} came back with another value")
        out.append(time.perf_counter() - t0)
    return out


def run_functions_bench(pool: Pool, s: FunctionsBench) -> dict[str, Any]:
    work = _main_function(_WORK_SOURCE, "work")
    warm = pool.function(work, name="bench-warm", cpus=s.cpus, keep_warm=120, max_workers=1)
    cold = pool.function(work, name="bench-cold", cpus=s.cpus, keep_warm=0, max_workers=s.workers)
    many = pool.function(work, name="bench-map", cpus=s.cpus, keep_warm=120, max_workers=s.workers)
    out: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        warm.remote(None)  # starts the worker
        out["warm_first_call_ms"] = round((time.perf_counter() - t0) * 1000, 1)
        warm_s = _timed(warm, s.warm_calls)
        cold_s = _timed(cold, s.cold_calls, idle=pool)
        # calls that wait a little make all `workers` workers start; they then stay warm for the map
        list(many.map(range(s.workers * 2), [0.5] * s.workers * 2))
        t0 = time.perf_counter()
        values = list(many.map(range(s.map_calls)))
        map_s = time.perf_counter() - t0
        if values != list(range(s.map_calls)):
            raise RuntimeError("map: results came back out of order or wrong")
    finally:
        for f in (warm, cold, many):
            with contextlib.suppress(Exception):  # a cleanup failure must not hide the figures
                f.delete()
    out |= {
        "warm_calls": len(warm_s),
        "warm_p50_ms": _ms(warm_s, 50),
        "warm_p99_ms": _ms(warm_s, 99),
        "cold_calls": len(cold_s),
        "cold_p50_ms": _ms(cold_s, 50),
        "cold_p99_ms": _ms(cold_s, 99),
        "map_calls": s.map_calls,
        "map_workers": s.workers,
        "map_s": round(map_s, 3),
        "map_calls_per_s": round(s.map_calls / map_s, 1) if map_s > 0 else 0.0,
    }
    return out


RAY_TIMEOUT_S = 600.0


def run_ray_side(s: FunctionsBench, python: str | None = None) -> dict[str, Any] | None:
    """The same warm calls and `map` as Ray tasks (bench_ray.py, run by `python`, which must have
    ray); None when that Python cannot import ray."""
    script = Path(__file__).with_name("bench_ray.py")
    argv = [python or sys.executable, str(script), str(s.warm_calls), str(s.map_calls), str(s.workers)]
    try:
        r = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=RAY_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"ray side: {e}") from None
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"ray side exited {r.returncode}: {tail}")
    out = json.loads(lines[-1])
    return out if isinstance(out, dict) else None
