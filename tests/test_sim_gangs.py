"""`cpool sim gangs`: gangs in a stream of single-GPU jobs, replayed with and without reservation
through the same scheduler code the control plane runs."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from computepool.core import Request
from computepool.sim.gangs import Job, TraceSpec, compare, replay_jobs, synthetic_trace

SMALL = Request(gpu_count=1, gpu_milli=1000)
GANG = Request(gpu_count=2, gpu_milli=1000, gang_nodes=2)


def test_trace_is_deterministic_from_the_seed() -> None:
    spec = TraceSpec(seed=5, hours=24)
    a, b = synthetic_trace(spec), synthetic_trace(spec)
    assert a == b and any(j.gang for j in a) and sum(not j.gang for j in a) > 100
    assert synthetic_trace(TraceSpec(seed=6, hours=24)) != a
    assert all(j.limit is not None and j.limit >= j.runtime for j in a)  # limits as users give them
    assert compare(spec) == compare(spec)


def test_gangs_wait_far_less_with_reservation() -> None:
    out = compare(TraceSpec(seed=3, hours=36, nodes=6, gang_nodes=3, gang_every_h=5))
    without, with_ = out["without_reservation"], out["with_reservation"]
    assert isinstance(without, dict) and isinstance(with_, dict)
    assert with_["gangs"] == without["gangs"] >= 3
    assert with_["gang_wait_p50_min"] < 0.5 * without["gang_wait_p50_min"], out
    assert with_["gang_wait_max_min"] < without["gang_wait_max_min"], out
    assert with_["gangs_started"] >= without["gangs_started"]
    assert with_["backfilled"] > 0 and without["backfilled"] == 0 and without["reserved_idle_gpu_h"] == 0


def test_backfill_starts_short_work_on_reserved_nodes_but_not_work_without_a_limit() -> None:
    spec = TraceSpec(nodes=2, gpus_per_node=2, gang_nodes=2)
    jobs = [
        Job(0, 0.0, 1000.0, 1000.0, SMALL),  # holds one GPU until t=1000
        Job(1, 1.0, 500.0, 600.0, GANG),  # needs both nodes whole: reserved from t=1000
        Job(2, 2.0, 5000.0, None, SMALL),  # no limit (runs long): would delay the gang
        Job(3, 3.0, 50.0, 100.0, SMALL),  # ends by t=103: backfilled
        Job(4, 4.0, 3000.0, 4000.0, SMALL),  # a limit past the shadow time: waits too
    ]
    with_ = replay_jobs(spec, jobs, reservation=True)
    starts = [w + j.submit for w, j in zip(with_.waits, jobs, strict=True)]
    assert starts[3] == 3.0 and with_.backfilled == 1
    assert starts[1] == 1000.0  # the gang starts at its shadow time
    assert starts[2] >= 1500.0 and starts[4] >= 1500.0  # after the gang
    without = replay_jobs(spec, jobs, reservation=False)
    starts = [w + j.submit for w, j in zip(without.waits, jobs, strict=True)]
    assert starts[2] == 2.0 and starts[3] == 3.0 and starts[4] == 4.0
    assert starts[1] == 5002.0  # the small jobs it let in delay the gang
    assert not any(math.isnan(w) for w in with_.waits + without.waits)


def test_cli_json_and_bad_input() -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "computepool.cli.main",
            "sim",
            "gangs",
            "--json",
            "--hours",
            "24",
            "--seed",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for side in ("with_reservation", "without_reservation"):
        for key in (
            "gang_wait_p50_min",
            "gang_wait_max_min",
            "small_wait_p50_min",
            "gpu_util_pct",
            "jobs_finished",
        ):
            assert key in out[side]
    assert "utilization_cost_pct_points" in out and out["spec"]["seed"] == 2
    bad = subprocess.run(
        [sys.executable, "-m", "computepool.cli.main", "sim", "gangs", "--gang-nodes", "9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == ["error: --gang-nodes: 9 is more than the pool's 8 nodes"]
