"""Which host ports a container may publish: the server's `--publish-ports` range, kept apart from
the ports the pool gives out and above 1023; anything else is refused at admission, naming `ports`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import Api

JOB = {"command": ["python3", "-c", "pass"], "image": "localhost/pybase:1", "cpu_milli": 100}


@pytest.mark.parametrize("port", [80, 1023, 24999, 26000, 29500, 31000])
def test_a_port_outside_the_range_is_refused_naming_ports(make_api: Callable[..., Api], port: int) -> None:
    api = make_api(publish_port_min=25000, publish_port_max=25999)
    r = api.post("/api/v1/allocations", json={**JOB, "ports": [25001, port]}, headers=api.admin)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "ports"
    assert r.json()[
        "error"
    ] == f"ports: {port} cannot be published: containers publish ports 25000-25999 only " + (
        "(a privileged port)" if port < 1024 else "(outside it)"
    )
    spec = {"request": {**JOB, "ports": [port]}}
    r = api.put("/api/v1/services/web", json={"spec": spec}, headers=api.admin)
    assert r.status_code == 422 and r.json()["field"] == "spec.request.ports", r.text


@pytest.mark.parametrize(
    ("ports", "words"),
    [
        ("abc", "--publish-ports: expected FIRST-LAST"),
        ("80-2000", "publish_port_min: Input should be greater than or equal to 1024"),
        ("29000-29600", "overlap the gang ports 29500-29999"),
        ("31500-31600", "overlap the service ports 31000-31999"),
        ("21000-20000", "must not exceed"),
    ],
)
def test_the_server_refuses_a_publish_range_that_is_privileged_or_overlaps(
    tmp_path: Path, ports: str, words: str
) -> None:
    argv = [sys.executable, "-m", "computepool.cli.main", "server", "--data-dir", str(tmp_path)]
    out = subprocess.run([*argv, "--publish-ports", ports], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and words in out.stderr + out.stdout, out
    assert "Traceback" not in out.stderr
