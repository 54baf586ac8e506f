"""`cpool run` as a user types it: output streamed, the command's exit code returned, bad input one line."""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

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
