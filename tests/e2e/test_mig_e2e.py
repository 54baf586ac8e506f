"""Tiers and MIG instances through the whole pool: `cpool up` with a simulated GPU split into MIG
instances beside a whole one, jobs run by the real agent, requests refused at admission."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import JOB_PYTHON, Pool, child_env, cpool, free_port, simulated_up, wait_for

SPEC = "1xA100-80GB:mig=3g.40gb+2g.20gb+2g.20gb,1xA100-80GB"
SHOW_GPU = "import os; print('visible', os.environ['CUDA_VISIBLE_DEVICES'])"


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pool, dict[str, str]]]:
    with simulated_up(tmp_path_factory.mktemp("mig"), SPEC) as up:
        yield up


def run(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cpool(*args), env=env, capture_output=True, text=True, timeout=timeout)


def devices(p: Pool) -> list[dict[str, Any]]:
    (node,) = p.nodes()
    return list(node["devices"])


def visible(r: subprocess.CompletedProcess[str]) -> str:
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("visible ")), None)
    assert line is not None, r.stdout + r.stderr
    return line.split()[1]


def test_the_node_reports_each_instance_as_a_device(pool: tuple[Pool, dict[str, str]]) -> None:
    p, _ = pool
    devs = devices(p)
    assert [d["model"] for d in devs] == ["A100-MIG-3g.40gb", "A100-MIG-2g.20gb", "A100-MIG-2g.20gb", "A100"]
    parent = devs[0]["mig_parent_uuid"]
    assert parent and all(d["mig_parent_uuid"] == parent for d in devs[:3])
    assert devs[3]["mig_parent_uuid"] is None
    assert [d["memory_mib"] for d in devs] == [40960, 20480, 20480, 81920]
    assert [d["compute_milli"] for d in devs] == [429, 286, 286, 1000]


def test_a_mig_job_sees_its_instance_and_a_whole_gpu_job_the_whole_gpu(
    pool: tuple[Pool, dict[str, str]],
) -> None:
    p, env = pool
    devs = devices(p)
    r = run(env, "run", "--mig", "2g.20gb", "--", JOB_PYTHON, "-c", SHOW_GPU)
    assert r.returncode == 0, r.stdout + r.stderr
    assert visible(r) in {d["uuid"] for d in devs if d["model"] == "A100-MIG-2g.20gb"}
    assert visible(r).startswith("MIG-")
    r = run(env, "run", "--gpus", "1", "--", JOB_PYTHON, "-c", SHOW_GPU)
    assert r.returncode == 0, r.stdout + r.stderr
    assert visible(r) == devs[3]["uuid"]
    r = run(env, "run", "--gpus", "0.4", "--isolation", "mig", "--", JOB_PYTHON, "-c", SHOW_GPU)
    assert r.returncode == 0, r.stdout + r.stderr
    assert visible(r) == devs[0]["uuid"]  # the smallest instance with 400m of its GPU: the 3g


def test_mps_and_timeslice_slices_never_share_a_device(pool: tuple[Pool, dict[str, str]]) -> None:
    p, env = pool
    r = p.http.post("/api/v1/allocations", json={"gpus": 1, "gpu_milli": 300, "isolation": "mps"})
    assert r.status_code == 201, r.text
    mps = int(r.json()["id"])
    wait_for("the mps slice", lambda: p.state(mps) == "bound", 30)
    (sl,) = p.get(mps)["slices"]
    assert sl["isolation"] == "mps" and sl["device_index"] == 3
    r = p.http.post("/api/v1/allocations", json={"gpus": 1, "gpu_milli": 300})
    assert r.status_code == 201, r.text
    ts = int(r.json()["id"])
    wait_for("a cycle to see it", lambda: "holds mps slices" in run(env, "explain", str(ts)).stdout, 30)
    assert p.state(ts) == "pending"
    another = p.http.post("/api/v1/allocations", json={"gpus": 1, "gpu_milli": 300, "isolation": "mps"})
    assert another.status_code == 201, another.text
    wait_for("a second mps slice on the same GPU", lambda: p.state(int(another.json()["id"])) == "bound", 30)
    assert p.get(int(another.json()["id"]))["slices"][0]["device_index"] == 3
    for a in (mps, int(another.json()["id"])):
        assert p.http.post(f"/api/v1/allocations/{a}/release").status_code == 200
    wait_for("the timeslice slice", lambda: p.state(ts) == "bound", 30)
    assert p.get(ts)["slices"][0]["isolation"] == "timeslice"
    assert p.http.post(f"/api/v1/allocations/{ts}/release").status_code == 200


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"gpus": 1, "gpu_memory_mib": 100000}, "gpu_memory_mib", "no GPU with 97.7GiB GPU memory"),
        ({"gpus": 2, "isolation": "mps"}, "isolation", "mps shares one device"),
        ({"gpus": 2, "mig": "2g.20gb"}, "mig", "a MIG instance is one device"),
        ({"gpus": 1, "mig": "1g.10gb"}, "mig", "no MIG instance 1g.10gb"),
        ({"gpus": 1, "isolation": "mig", "gpu_memory_mib": 50000}, "isolation", "no MIG instance with"),
    ],
)
def test_what_no_node_could_ever_hold_is_refused(
    pool: tuple[Pool, dict[str, str]], body: dict[str, Any], field: str, words: str
) -> None:
    p, _ = pool
    r = p.http.post("/api/v1/allocations", json=body)
    assert r.status_code == 422, r.text
    assert r.json().get("field") == field, r.text
    assert words in r.json()["error"], r.text


def test_bad_simulate_specs_are_one_line(tmp_path: Path) -> None:
    for spec, words in (
        ("1xA100-80GB:mig=4g.40gb+4g.40gb", "take 8 slices, more than the GPU's 7"),
        ("1xA100-40GB:mig=3g.40gb+2g.20gb", "more than the GPU's 40960 MiB"),
        ("1xA100-80GB:mig=5g.50gb", "unknown MIG profile '5g.50gb'"),
    ):
        for cmd in (
            ["up", "--simulate", spec, "--data-dir", str(tmp_path / "d"), "--port", str(free_port())],
            [
                "agent",
                "--simulate",
                spec,
                "--server",
                "http://127.0.0.1:9",
                "--data-dir",
                str(tmp_path / "a"),
            ],
        ):
            r = subprocess.run(cpool(*cmd), env=child_env(), capture_output=True, text=True, timeout=60)
            lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
            assert r.returncode != 0 and len(lines) == 1, r.stderr
            assert words in lines[0] and spec in lines[0] and "Traceback" not in r.stderr, r.stderr
