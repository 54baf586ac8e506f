"""Ray side by side for `cpool bench functions`: the same no-op calls as Ray tasks.

Run as a script by whichever Python has ray (`python bench_ray.py WARM MAP WORKERS`); it imports
only the standard library and ray, so that Python needs no computepool, and ray never becomes a
dependency. Prints one JSON value: the figures, or null when ray cannot be imported. Ray runs
locally (`ray.init(num_cpus=WORKERS)`) with its files in a temp dir of its own.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
import tempfile
import time


def _ms(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return round(ordered[max(1, math.ceil(pct / 100 * len(ordered))) - 1] * 1000, 2)


def main(argv: list[str]) -> None:
    warm_calls, map_calls, workers = (int(a) for a in argv)
    try:
        ray = importlib.import_module("ray")  # not a dependency: whichever Python runs this may have it
    except ImportError:
        print("null")
        return
    with tempfile.TemporaryDirectory(prefix="cpool-bench-ray-") as tmp:
        ray.init(
            num_cpus=workers,
            include_dashboard=False,
            log_to_driver=False,
            logging_level="ERROR",
            _temp_dir=tmp,
        )
        try:

            @ray.remote
            def work(x: object = None, pause: float = 0) -> object:
                if pause:
                    time.sleep(pause)
                return x

            t0 = time.perf_counter()
            ray.get(work.remote(None))  # starts a worker
            first = time.perf_counter() - t0
            warm = []
            for i in range(warm_calls):
                t0 = time.perf_counter()
                if ray.get(work.remote(i)) != i:
                    raise RuntimeError(f"call {i} came back with another value")
                warm.append(time.perf_counter() - t0)
            # calls that wait a little make every worker start, as the pool side's map does
            ray.get([work.remote(i, 0.5) for i in range(workers * 2)])
            t0 = time.perf_counter()
            values = ray.get([work.remote(i) for i in range(map_calls)])
            map_s = time.perf_counter() - t0
            if values != list(range(map_calls)):
                raise RuntimeError("map: results came back out of order or wrong")
        finally:
            ray.shutdown()
    print(
        json.dumps(
            {
                "warm_first_call_ms": round(first * 1000, 1),
                "warm_p50_ms": _ms(warm, 50),
                "warm_p99_ms": _ms(warm, 99),
                "map_calls_per_s": round(map_calls / map_s, 1) if map_s > 0 else None,
                "map_workers": workers,
                "version": ray.__version__,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1:])
