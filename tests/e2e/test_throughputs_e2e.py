"""Measured speeds end to end: a job run with `cpool run --job-type` writes its progress file (the
documented format, without the SDK), a real agent reads it at its heartbeats and reports steps/s,
and `cpool throughputs` shows the pool's mean for the job type on the node's device model."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_helpers import JOB_PYTHON, Pool, child_env, cpool, free_port, stop, wait_for

# about 200 steps/s for 2 s, each count written whole through a rename
JOB = """
import json, os, time
path = os.environ["CPOOL_PROGRESS_FILE"]
t0 = time.time()
while time.time() - t0 < 2:
    now = time.time()
    with open(path + ".tmp", "w") as f:
        json.dump({"step": int((now - t0) * 200), "time": now}, f)
    os.replace(path + ".tmp", path)
    time.sleep(0.05)
"""


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pool, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("speeds")
    data, port = tmp / "server", free_port()
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []

    def output() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in logs if p.exists())

    def start(name: str, *args: str, env: dict[str, str] | None = None) -> None:
        log = tmp / f"{name}.log"
        logs.append(log)
        with log.open("wb") as out:
            procs.append(
                subprocess.Popen(cpool(*args), stdout=out, stderr=subprocess.STDOUT, env=env or child_env())
            )

    try:
        start(
            "server", "server", "--data-dir", str(data), "--port", str(port),
            "--heartbeat-s", "0.5", "--suspect-s", "3", "--lost-s", "6",
        )  # fmt: skip
        wait_for(
            "the server", lambda: (data / "admin-token").exists() and Pool(url, data).ready(), 30, output
        )
        api = Pool(url, data)
        token = api.http.post("/api/v1/join-tokens", json={}).json()["token"]
        start(
            "agent", "agent", "--server", url, "--data-dir", str(tmp / "agent"), "--simulate", "1xT4-16GB",
            "--name", "speed-1", env={**child_env(), "CPOOL_JOIN_TOKEN": token},
        )  # fmt: skip
        wait_for("the node", lambda: [n["state"] for n in api.nodes()] == ["ready"], 40, output)
        env = {**child_env(), "CPOOL_SERVER": url, "CPOOL_TOKEN": (data / "admin-token").read_text().strip()}
        yield api, env
        assert "Traceback" not in output(), output()
        api.close()
    finally:
        for p in reversed(procs):
            stop(p, signal.SIGTERM, timeout=30)


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cpool(*args), env=env, capture_output=True, text=True, timeout=60)


def test_a_jobs_progress_becomes_the_pools_speed_for_its_type(pool: tuple[Pool, dict[str, str]]) -> None:
    _, env = pool
    r = run(
        env, "run", "-n", "--no-code", "--gpus", "1", "--job-type", "resnet50", "--", JOB_PYTHON, "-c", JOB
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(run(env, "throughputs", "--json").stdout)
    assert [(x["tenant"], x["job_type"], x["model"], x["devices"]) for x in rows] == [
        ("default", "resnet50", "T4", 1)
    ]
    assert rows[0]["samples"] >= 1 and 120 <= rows[0]["steps_per_s"] <= 280, rows
    table = run(env, "throughputs")
    assert table.returncode == 0 and "resnet50" in table.stdout and "T4" in table.stdout
    bad = run(env, "run", "-n", "--no-code", "--job-type", "Res Net", "--", "true")
    lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert bad.returncode != 0 and "job_type" in bad.stderr and len(lines) == 1, bad.stderr
