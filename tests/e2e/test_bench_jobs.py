"""`cpool bench jobs`: tiny jobs on a pool it starts itself, and Slurm beside it when installed."""

from __future__ import annotations

import json
import shutil
import subprocess

import psutil
from e2e_helpers import child_env, cpool

TOP_KEYS = {
    "e2e_p50_ms",
    "e2e_p99_ms",
    "jobs_per_s",
    "cli_submit_ms",
    "daemon_cpu_s_per_100_jobs",
    "agent_idle_cpu_s_per_min",
    "slurm",
    "after_20k",
}


def _slurm_daemons_left() -> list[str]:
    left = []
    for p in psutil.process_iter(["cmdline"]):
        argv = p.info["cmdline"] or []
        if any("cpool-bench-slurm-" in a for a in argv):
            left.append(" ".join(argv))
    return left


def test_bench_jobs_small_run_reports_every_figure() -> None:
    argv = cpool(
        "bench", "jobs", "--jobs", "6", "--slots", "3", "--samples", "1", "--history", "12",
        "--history-batch", "4", "--idle-seconds", "1", "--no-slurm-defaults", "--json",
    )  # fmt: skip
    done = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    out = json.loads(lines[0])
    assert out.keys() >= TOP_KEYS, out
    assert 0 < out["e2e_p50_ms"] <= out["e2e_p99_ms"]
    assert out["jobs_per_s"] > 0 and out["cli_submit_ms"] > 0
    assert out["daemon_cpu_s_per_100_jobs"] > 0
    assert out["agent_idle_cpu_s_per_min"] >= 0
    assert out["detail"]["failed"] == 0, out["detail"]["error_samples"]
    assert out["detail"]["cpu_milli_per_job"] > 0
    after = out["after_20k"]
    assert after["e2e_p50_ms"] > 0 and after["agent_idle_cpu_s_per_min"] >= 0
    assert after["history"]["jobs"] == 12 and after["history"]["submit_errors"] == 0
    if shutil.which("slurmctld") is None:
        assert out["slurm"] is None
    else:
        slurm = out["slurm"]
        assert 0 < slurm["e2e_p50_ms"] <= slurm["e2e_p99_ms"]
        assert slurm["jobs_per_s"] > 0 and slurm["daemon_cpu_s_per_100_jobs"] > 0
        assert slurm["jobs"] == 6 and slurm["slots"] == 3 and "default_scheduler" not in slurm
        assert _slurm_daemons_left() == []


def test_bench_jobs_refuses_bad_sizes_in_one_line() -> None:
    done = subprocess.run(
        cpool("bench", "jobs", "--jobs", "0"), env=child_env(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "--jobs" in done.stderr and "Traceback" not in done.stderr
