"""`cpool bench starts` and `cpool bench agents` against pools they start themselves."""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime, timedelta
from typing import Any

from e2e_helpers import child_env, cpool

from computepool.client.bench_pool import peak_overlap

JOBS_KEYS = {
    "start_latency_p50_ms",
    "start_latency_p99_ms",
    "end_to_end_p50_ms",
    "jobs",
    "failed",
    "elapsed_s",
}
AGENTS_KEYS = {
    "heartbeat_lag_p50_ms",
    "heartbeat_lag_p99_ms",
    "heartbeats",
    "errors",
    "nodes_ready_at_end",
    "server_cpu_pct",
    "agents",
    "seconds",
}


def bench(*args: str, timeout: float = 90) -> dict[str, Any]:
    r = subprocess.run(
        cpool("bench", *args), env=child_env(), capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, r.stdout
    out = json.loads(lines[0])
    assert isinstance(out, dict)
    return out


def test_bench_jobs_on_a_pool_it_starts() -> None:
    out = bench("starts", "--start-pool", "--count", "10", "--concurrency", "4", "--json")
    assert out.keys() >= JOBS_KEYS, out
    assert out["jobs"] == 10 and out["failed"] == 0, out
    assert out["completed"] == 10
    assert 0 <= out["start_latency_p50_ms"] <= out["start_latency_p99_ms"]
    assert out["end_to_end_p50_ms"] > 0


def test_bench_jobs_hold_runs_them_side_by_side() -> None:
    out = bench(
        "starts",
        "--start-pool",
        "--count",
        "8",
        "--concurrency",
        "8",
        "--hold",
        "3",
        "--cpus",
        "0.01",
        "--json",
    )
    assert out["completed"] == 8 and out["failed"] == 0, out
    assert out["peak_running"] == 8, out  # one agent ran all eight at once
    assert out["end_to_end_p50_ms"] >= 3000


def test_peak_overlap_counts_spans_open_together() -> None:
    t = [datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=s) for s in range(10)]
    assert peak_overlap([]) == 0
    assert peak_overlap([(t[0], t[2]), (t[2], t[4])]) == 1  # one ends as the next starts
    assert peak_overlap([(t[0], t[5]), (t[1], t[3]), (t[2], t[4]), (t[6], t[7])]) == 3


def test_bench_cycle_on_a_scratch_database() -> None:
    out = bench("cycle", "--nodes", "20", "--pending", "200", "--cycles", "2", "--churn", "10", "--json")
    assert out["database"] == "sqlite" and out["gpus"] == 160 and out["pending"] == 200
    first = out["first"]
    assert first["binds"] > 0 and first["pending"] == 200
    assert first["seconds"] >= first["decide_s"] >= 0
    assert [c["binds"] for c in out["steady"]] == [0, 0]  # nothing more fits until something ends
    assert all(c["binds"] > 0 for c in out["churn"])


def test_bench_agents_on_a_server_it_starts() -> None:
    out = bench("agents", "--start-server", "--count", "20", "--seconds", "6", "--interval", "2", "--json")
    assert out.keys() >= AGENTS_KEYS, out
    assert out["errors"] == 0, out
    assert out["nodes_ready_at_end"] == 20
    assert out["agents"] == 20 and out["seconds"] == 6
    assert out["heartbeats"] == 60  # 20 agents x 3 beats in 6 s at 2 s
    assert 0 <= out["heartbeat_lag_p50_ms"] <= out["heartbeat_lag_p99_ms"]
    assert out["server_cpu_pct"] is not None and out["server_cpu_pct"] >= 0


def test_bench_agents_refuses_a_remote_server() -> None:
    r = subprocess.run(
        cpool("bench", "agents", "--server", "http://10.1.2.3:8470", "--token", "x", "--json"),
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode != 0
    assert "not loopback" in r.stderr and "Traceback" not in r.stderr
