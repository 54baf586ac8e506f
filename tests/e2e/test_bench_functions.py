"""`cpool bench functions` runs against the pool $CPOOL_SERVER/$CPOOL_TOKEN name, as its help says."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from e2e_helpers import cpool, local_pool


def test_bench_functions_uses_the_pool_the_environment_names(tmp_path: Path) -> None:
    with local_pool(tmp_path) as (env, _pool):
        argv = cpool(
            "bench", "functions", "--warm-calls", "2", "--cold-calls", "1", "--map-calls", "4",
            "--workers", "1", "--json",
        )  # fmt: skip
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["server"] == env["CPOOL_SERVER"], out
    assert out["warm_calls"] == 2 and out["map_calls"] == 4
    assert out["warm_p50_ms"] > 0 and out["map_calls_per_s"] > 0
    # Ray beside it only where ray imports: figures then, else null
    assert "ray" in out, out
    assert out["ray"] is None or out["ray"]["warm_p50_ms"] > 0, out
