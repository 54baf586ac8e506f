"""Allocations through the CLI against the real scheduler: alloc → bound → ps → explain → release; bench."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from poolkit import Cli, PoolServer, needs_allocations, one_error_line, start_server

from computepool.client import PoolClient

pytestmark = needs_allocations


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolServer]:
    """A pool of its own with two 2-GPU nodes that send no heartbeat: they stay ready however long
    the module takes on a busy machine (with the default 20 s they went suspect, and an `alloc`
    waiting for them waited for ever)."""
    quiet = ("--suspect-s", "86400", "--lost-s", "172800")
    with start_server(tmp_path_factory.mktemp("allocpool"), *quiet) as s, PoolClient(s.url, s.token) as admin:
        jt = admin.create_join_token(single_use=False)["token"]
        for name in ("g1", "g2"):
            devices = [
                {
                    "index": i,
                    "vendor": "nvidia",
                    "model": "A100",
                    "memory_mib": 40960,
                    "uuid": f"GPU-{name}-{i}",
                }
                for i in range(2)
            ]
            admin.join_node(jt, name, cpu_milli=32000, memory_mib=131072, devices=devices)
        yield s


def test_alloc_bound_ps_explain_release(cli: Cli) -> None:
    r = cli(
        "alloc",
        "--gpus",
        "0.5",
        "--gpu-mem",
        "10GiB",
        "--cpus",
        "2",
        "--mem",
        "4GiB",
        "--name",
        "nb",
        "--json",
    )
    assert r.exit_code == 0, r.output
    a = json.loads(r.stdout)
    assert a["state"] in ("bound", "active") and a["name"] == "nb"
    assert a["request"]["gpu_milli"] == 500 and a["request"]["gpu_memory_mib"] == 10240
    [s] = a["slices"]
    assert (s["compute_milli"], s["memory_mib"]) == (500, 10240)
    env = a["environment"][s["node"]]
    assert env == {"CUDA_VISIBLE_DEVICES": s["device_uuid"], "CPOOL_ALLOCATION_ID": str(a["id"])}

    ps = json.loads(cli("ps", "--json").stdout)
    assert a["id"] in [x["id"] for x in ps]
    assert "nb" in cli("ps").stdout
    ex = json.loads(cli("explain", str(a["id"]), "--json").stdout)
    assert ex["state"] == a["state"] and ex["summary"]
    assert ex["summary"].split()[0] in cli("explain", str(a["id"])).stdout
    assert "50%" in cli("nodes").stdout  # the bar of the half-allocated device

    r = cli("release", str(a["id"]))
    assert r.exit_code == 0 and "released" in r.stdout
    assert a["id"] not in [x["id"] for x in json.loads(cli("ps", "--json").stdout)]
    assert a["id"] in [x["id"] for x in json.loads(cli("ps", "--all", "--json").stdout)]


def test_alloc_prints_how_to_use_it(cli: Cli) -> None:
    r = cli("alloc", "--gpus", "2", "--model", "A100")
    assert r.exit_code == 0, r.output
    assert "export CUDA_VISIBLE_DEVICES=GPU-" in r.stdout and "export CPOOL_ALLOCATION_ID=" in r.stdout
    alloc_id = r.stdout.split("export CPOOL_ALLOCATION_ID=")[1].split()[0]
    assert cli("release", alloc_id).exit_code == 0


def test_no_wait_cancel_timeout_and_refusal(cli: Cli) -> None:
    r = cli("alloc", "--gpus", "1", "--no-wait", "--json")
    a = json.loads(r.stdout)
    out = json.loads(cli("cancel", str(a["id"]), "--json").stdout)
    assert out["state"] == "cancelled"
    fillers = [json.loads(cli("alloc", "--gpus", "2", "--json").stdout)["id"] for _ in range(2)]
    r = cli("alloc", "--gpus", "1", "--timeout", "1")  # the pool is full: progress, then the error
    assert r.exit_code == 1 and "Traceback" not in r.stdout + r.stderr
    assert "pending" in r.stderr.splitlines()[0]
    assert "not bound within 1 s, cancelled" in r.stderr.splitlines()[-1]
    assert {x["state"] for x in json.loads(cli("ps", "--json").stdout)} == {"bound"}
    for f in fillers:
        assert cli("release", str(f)).exit_code == 0
    assert "model" in one_error_line(cli("alloc", "--gpus", "1", "--model", "H100"))  # never fits
    assert "999999" in one_error_line(cli("release", "999999"))


def test_bench_api_short_run(cli: Cli, server: PoolServer) -> None:
    r = cli("bench", "api", "--clients", "4", "--seconds", "3", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    keys = {"ops_per_s", "p50_ms", "p99_ms", "cycle_p50_ms", "cycle_p99_ms", "errors", "clients", "seconds"}
    assert keys <= out.keys()
    assert out["errors"] == 0, out["error_samples"]
    assert out["clients"] == 4 and out["cycles"] > 0 and out["ops_per_s"] > 0
    assert "not loopback" in one_error_line(cli("bench", "api", "--server", "http://10.0.0.1:8470"))


def test_bench_joins_simulated_nodes_when_the_pool_is_empty(cli: Cli, tmp_path: Path) -> None:
    with start_server(tmp_path) as s:
        env = {"CPOOL_SERVER": s.url, "CPOOL_TOKEN": s.token}
        r = cli("bench", "api", "--clients", "2", "--seconds", "1", "--nodes", "2", "--json", env=env)
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        assert out["nodes_joined"] == 2 and out["errors"] == 0 and out["cycles"] > 0
        assert json.loads(cli("nodes", "--json", env=env).stdout) == []  # removed afterwards


def test_bench_with_a_member_token_uses_the_pools_nodes(cli: Cli, tmp_path: Path) -> None:
    with (
        start_server(tmp_path, "--suspect-s", "86400", "--lost-s", "172800") as s,
        PoolClient(s.url, s.token) as admin,
    ):
        jt = admin.create_join_token(single_use=False)["token"]
        dev = {"index": 0, "vendor": "nvidia", "model": "A100", "memory_mib": 40960, "uuid": "GPU-m0"}
        admin.join_node(jt, "m1", cpu_milli=32000, memory_mib=131072, devices=[dev])
        admin.create_user("mia", "default", "member")
        member = admin.create_token(user="mia")["token"]
        env = {"CPOOL_SERVER": s.url, "CPOOL_TOKEN": member}
        r = cli("bench", "api", "--clients", "2", "--seconds", "1", "--json", env=env)
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        assert out["nodes_joined"] == 0 and out["errors"] == 0 and out["cycles"] > 0, out
