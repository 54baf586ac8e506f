"""cli/: the commands print one JSON object with --json, and bad input gives one line, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from computepool.cli import main as cli_main

FILL_KEYS = {
    "policy",
    "seed",
    "tune",
    "workload",
    "unallocated_pct_at_100",
    "unallocated_pct_at_130",
    "frag_rate_pct_at_90",
    "pods_arrived",
    "pods_failed",
    "offline_ffd_unallocated_pct",
    "lower_bound_unallocated_pct",
    "elapsed_s",
}
SHARING_KEYS = {
    "pods_placed",
    "pods_failed",
    "requested_gpu_milli_placed",
    "idle_gpus",
    "capacity_serving_requests_pct",
}
BENCH_KEYS = {
    "policy",
    "nodes",
    "gpus_per_node",
    "requests",
    "placements_per_s",
    "p99_decision_ms",
    "p50_decision_ms",
    "placed",
    "failed",
}


def _registered() -> bool:
    names = {c.name for c in cli_main.sim_app.registered_commands}
    return "fill" in names


@pytest.fixture(scope="module")
def app():
    if not _registered():  # main() registers on every call; register once for the test runner
        cli_main._register()
    return cli_main.app


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


def one_json(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, stdout
    obj = json.loads(lines[0])
    assert isinstance(obj, dict)
    return obj


def assert_one_line_error(result, *needles: str) -> str:
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1, result.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# --- sim fill ----------------------------------------------------------------------------------


def test_sim_fill_json_real_trace(app, runner, alibaba_dir):
    r = runner.invoke(app, ["sim", "fill", "--policy", "bestfit", "--seed", "42", "--json", "--no-curve"])
    assert r.exit_code == 0, r.output
    out = one_json(r.stdout)
    assert set(out) >= FILL_KEYS
    assert "curve" not in out
    assert out["policy"] == "bestfit" and out["seed"] == 42 and out["tune"] == 1.3
    assert out["workload"] == "default"
    assert 5.5 <= out["unallocated_pct_at_100"] <= 8.5
    assert out["lower_bound_unallocated_pct"] <= out["offline_ffd_unallocated_pct"]
    assert out["pods_arrived"] > 8152


def test_sim_fill_json_with_curve(app, runner, tiny_csvs):
    nodes, pods = tiny_csvs
    r = runner.invoke(
        app,
        [
            "sim",
            "fill",
            "--cluster",
            str(nodes),
            "--workload",
            str(pods),
            "--policy",
            "fgd",
            "--seed",
            "3",
            "--tune",
            "1.0",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    out = one_json(r.stdout)
    assert FILL_KEYS | {"curve"} <= set(out)
    assert out["workload"] == "pods" and out["policy"] == "fgd" and out["seed"] == 3
    assert isinstance(out["curve"], list) and all(len(pt) == 2 for pt in out["curve"])
    assert out["pods_arrived"] == 12


@pytest.mark.parametrize(
    "policy", ["random", "dotprod", "clustering", "packing", "bestfit", "fgd", "default"]
)
def test_sim_fill_every_policy_tiny(app, runner, tiny_csvs, policy):
    nodes, pods = tiny_csvs
    r = runner.invoke(
        app,
        [
            "sim",
            "fill",
            "--cluster",
            str(nodes),
            "--workload",
            str(pods),
            "--policy",
            policy,
            "--json",
            "--no-curve",
        ],
    )
    assert r.exit_code == 0, r.output
    out = one_json(r.stdout)
    assert out["policy"] == policy
    assert 0 <= out["pods_failed"] <= out["pods_arrived"]


def test_sim_fill_table(app, runner, tiny_csvs):
    nodes, pods = tiny_csvs
    r = runner.invoke(
        app, ["sim", "fill", "--cluster", str(nodes), "--workload", str(pods), "--policy", "bestfit"]
    )
    assert r.exit_code == 0, r.output
    assert "unallocated_pct_at_100" in r.stdout
    assert "pods_arrived" in r.stdout


# --- sim static-vs-pooled ----------------------------------------------------------------------


def test_static_vs_pooled_json(app, runner, tiny_csvs):
    nodes, pods = tiny_csvs
    r = runner.invoke(
        app, ["sim", "static-vs-pooled", "--cluster", str(nodes), "--workload", str(pods), "--json"]
    )
    assert r.exit_code == 0, r.output
    out = one_json(r.stdout)
    assert set(out) == {"static", "pooled", "savings"}
    for at in ("at_100", "at_end"):  # energy and cost per served GPU-hour, pooled against static
        assert set(out["savings"][at]) >= {
            "kwh_per_served_gpu_hour_saved_pct",
            "cost_per_served_gpu_hour_saved_pct",
        }
    for mode in ("static", "pooled"):
        assert set(out[mode]) >= SHARING_KEYS
        assert out[mode]["mode"] == mode
    assert out["pooled"]["pods_placed"] >= out["static"]["pods_placed"]
    assert out["pooled"]["pods_arrived"] == out["static"]["pods_arrived"]


# --- bench scheduler ---------------------------------------------------------------------------


def test_bench_scheduler_json(app, runner):
    r = runner.invoke(
        app,
        [
            "bench",
            "scheduler",
            "--nodes",
            "50",
            "--gpus-per-node",
            "8",
            "--requests",
            "2000",
            "--policy",
            "bestfit",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    out = one_json(r.stdout)
    assert set(out) >= BENCH_KEYS
    assert out["nodes"] == 50 and out["gpus_per_node"] == 8 and out["requests"] == 2000
    assert out["placements_per_s"] > 0 and out["p99_decision_ms"] >= out["p50_decision_ms"] >= 0
    assert out["placed"] + out["failed"] == 2000


# --- bad input ---------------------------------------------------------------------------------


def test_missing_workload_file(app, runner, tmp_path, tiny_csvs):
    nodes, _ = tiny_csvs
    missing = tmp_path / "nowhere.csv"
    r = runner.invoke(app, ["sim", "fill", "--cluster", str(nodes), "--workload", str(missing), "--json"])
    line = assert_one_line_error(r, "nowhere.csv", "cannot open")
    assert line.startswith("error:")


def test_malformed_csv_names_file_and_line(app, runner, tiny_csvs):
    nodes, pods = tiny_csvs
    lines = pods.read_text().splitlines()
    lines[3] = lines[3].replace(",1,250,", ",1,1250,")  # pod p02 on line 4 asks for 1250 milli
    assert "1250" in lines[3]
    pods.write_text("\n".join(lines) + "\n")
    for cmd in (["sim", "fill"], ["sim", "static-vs-pooled"]):
        r = runner.invoke(app, [*cmd, "--cluster", str(nodes), "--workload", str(pods), "--json"])
        assert_one_line_error(r, "pods.csv:4", "gpu_milli")


def test_malformed_cluster_csv(app, runner, tiny_csvs):
    nodes, pods = tiny_csvs
    nodes.write_text("sn,cpu_milli,memory_mib,gpu\nnode-a,1,1,1\n")
    r = runner.invoke(app, ["sim", "fill", "--cluster", str(nodes), "--workload", str(pods)])
    assert_one_line_error(r, "nodes.csv:1", "model")


def test_unknown_policy(app, runner, tiny_csvs):
    nodes, pods = tiny_csvs
    r = runner.invoke(
        app, ["sim", "fill", "--cluster", str(nodes), "--workload", str(pods), "--policy", "nope"]
    )
    assert_one_line_error(r, "--policy", "nope")
    r = runner.invoke(app, ["bench", "scheduler", "--nodes", "2", "--requests", "5", "--policy", "nope"])
    assert_one_line_error(r, "--policy")
    r = runner.invoke(app, ["bench", "scheduler", "--nodes", "2", "--requests", "5", "--policy", "fgd"])
    assert_one_line_error(r, "--policy")


def test_out_of_range_option_no_traceback(app, runner):
    r = runner.invoke(app, ["sim", "fill", "--tune", "0", "--json"])
    assert r.exit_code != 0
    assert "Traceback" not in r.output
    assert "--tune" in r.output


# --- the installed console script --------------------------------------------------------------


def test_cpool_console_script(tiny_csvs):
    nodes, pods = tiny_csvs
    exe = shutil.which("cpool")
    assert exe is not None, "the cpool console script is not installed (pip install -e .)"
    args = [
        "sim",
        "fill",
        "--cluster",
        str(nodes),
        "--workload",
        str(pods),
        "--policy",
        "bestfit",
        "--json",
        "--no-curve",
    ]
    p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = one_json(p.stdout)
    assert set(out) >= FILL_KEYS and out["policy"] == "bestfit"
    bad = subprocess.run(
        [exe, "sim", "fill", "--workload", str(Path(pods).with_name("x.csv")), "--cluster", str(nodes)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0
    assert "Traceback" not in bad.stderr + bad.stdout
    assert "x.csv" in bad.stderr


def test_module_entry_point_help():
    p = subprocess.run(
        [sys.executable, "-m", "computepool.cli.main", "sim", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert "fill" in p.stdout and "static-vs-pooled" in p.stdout
