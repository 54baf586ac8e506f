"""`cpool run` as a user types it: output streamed, the command's exit code returned, bad input one line."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_helpers import JOB_PYTHON, Pool, child_env, cpool, free_port, stop, wait_for


@pytest.fixture(scope="module")
def pool_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("run")
    data, port, log = tmp / "pool", free_port(), tmp / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cpool("up", "--simulate", "1xA100-80GB", "--data-dir", str(data), "--port", str(port)),
            stdout=out, stderr=subprocess.STDOUT, env=child_env(),
        )  # fmt: skip
    try:
        wait_for("cpool up", lambda: "ComputePool is up" in log.read_text(), 60, log.read_text)
        pool = Pool(f"https://127.0.0.1:{port}", data)
        wait_for("the local node", lambda: [n["state"] for n in pool.nodes()] == ["ready"], 30)
        pool.close()
        env = child_env()
        env["CPOOL_SERVER"] = f"https://127.0.0.1:{port}"
        env["CPOOL_CA"] = str(data / "tls" / "cert.pem")
        env["CPOOL_TOKEN"] = (data / "admin-token").read_text().strip()
        yield env
    finally:
        stop(proc, signal.SIGINT, timeout=40)


def run(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cpool(*args), env=env, capture_output=True, text=True, timeout=timeout)


def test_run_streams_output_and_returns_the_exit_code(pool_env: dict[str, str]) -> None:
    code = "import os; print('hello', os.environ['CUDA_VISIBLE_DEVICES'][:4]); raise SystemExit(3)"
    r = run(pool_env, "run", "--gpus", "0.5", "--", JOB_PYTHON, "-c", code)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "hello GPU-" in r.stdout
    assert "Traceback" not in r.stderr


def test_run_success_is_zero_and_cpu_only_jobs_see_no_gpu(pool_env: dict[str, str]) -> None:
    code = "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"
    r = run(pool_env, "run", "--cpus", "0.5", "--", JOB_PYTHON, "-c", code)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "''" in r.stdout


def test_run_a_command_that_does_not_exist(pool_env: dict[str, str]) -> None:
    r = run(pool_env, "run", "--", "no-such-command-xyz")
    assert r.returncode == 127, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert "no-such-command-xyz" in r.stderr


def test_run_bad_input_is_one_line(pool_env: dict[str, str], tmp_path: Path) -> None:
    for args in (["run", "--gpus", "1.5", "--", "true"], ["run", "--mem", "10XB", "--", "true"], ["run"]):
        r = run(pool_env, *args)
        assert r.returncode != 0
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr


def test_run_detach_then_logs(pool_env: dict[str, str]) -> None:
    r = run(pool_env, "run", "--detach", "--", JOB_PYTHON, "-c", "print('detached hi')")
    assert r.returncode == 0, r.stderr
    submitted = re.search(r"job (\d+) submitted", r.stderr)  # after the line about the shipped code
    assert submitted, r.stderr
    job_id = submitted.group(1)
    logs = run(pool_env, "logs", "--follow", job_id)
    assert "detached hi" in logs.stdout, logs.stdout + logs.stderr


def _explain_calls(pool: Pool) -> float:
    """GET …/explain answers so far, from the server's request-latency histogram."""
    text = pool.http.get("/metrics").text
    route = 'route="/api/v1/allocations/{alloc_id}/explain"'
    return sum(
        float(x.split()[-1])
        for x in text.splitlines()
        if x.startswith("cpool_api_request_seconds_count") and route in x
    )


def test_run_pending_shows_the_reason_the_scheduler_stored(pool_env: dict[str, str], tmp_path: Path) -> None:
    """While it waits, `cpool run` shows the allocation's stored reason: no explain each poll."""
    pool = Pool(pool_env["CPOOL_SERVER"], Path(pool_env["CPOOL_CA"]).parent.parent)
    holder = pool.http.post("/api/v1/allocations", json={"gpus": 1, "exclusive": True})
    assert holder.status_code == 201, holder.text
    holder_id = int(holder.json()["id"])
    err = tmp_path / "run.err"
    proc: subprocess.Popen[bytes] | None = None
    try:
        wait_for("the whole device held", lambda: pool.state(holder_id) == "bound", 30)
        explained = _explain_calls(pool)
        with err.open("wb") as out:
            proc = subprocess.Popen(
                cpool("run", "--gpus", "1", "--", JOB_PYTHON, "-c", "print('ran at last')"),
                env=pool_env, stdout=subprocess.PIPE, stderr=out,
            )  # fmt: skip

        def stored() -> str | None:
            waiting = pool.http.get("/api/v1/allocations", params={"state": "pending"}).json()["items"]
            why = [a["reason"] for a in waiting if a["reason"] != "submitted"]
            line = f"pending: {why[0]}" if why else None
            return line if line is not None and line in err.read_text() else None

        line = wait_for("the stored reason on stderr", stored, 30, err.read_text)
        assert _explain_calls(pool) == explained, "a pending run asked for explain"
        assert pool.http.post(f"/api/v1/allocations/{holder_id}/release").status_code == 200
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and b"ran at last" in out, err.read_text()
        assert line in err.read_text() and "Traceback" not in err.read_text()
    finally:
        if proc is not None:
            stop(proc, signal.SIGINT)
        with contextlib.suppress(httpx.HTTPError):
            pool.http.post(f"/api/v1/allocations/{holder_id}/release")
        pool.close()
