"""`cpool run` ended by SIGTERM (e.g. `timeout`) or SIGHUP (a closed terminal) cancels its job, as
Ctrl-C does, whether the job runs or still waits; `--detach` leaves it alone."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_helpers import JOB_PYTHON, Pool, cpool, local_pool, wait_for

LONG_JOB = "import time; print('started', flush=True); time.sleep(600)"


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, str], Pool]]:
    tmp = tmp_path_factory.mktemp("signals")
    with local_pool(tmp) as (env, p):
        (tmp / "cwd").mkdir()  # `cpool run` ships its working directory: an empty one here
        yield {**env, "PWD": str(tmp / "cwd")}, p


def named(p: Pool, name: str) -> dict[str, Any] | None:
    items = p.http.get("/api/v1/allocations").json()["items"]
    return next((a for a in items if a.get("name") == name), None)


def start(env: dict[str, str], name: str, *args: str) -> subprocess.Popen[str]:
    argv = cpool("run", "--name", name, *args, "--", JOB_PYTHON, "-c", LONG_JOB)
    return subprocess.Popen(
        argv, env=env, cwd=env["PWD"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def ended(proc: subprocess.Popen[str]) -> tuple[int, str]:
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_a_signal_cancels_a_running_job(pool: tuple[dict[str, str], Pool], sig: int, code: int) -> None:
    env, p = pool
    name = f"running-{code}"
    proc = start(env, name)
    try:
        job = wait_for("the job to run", lambda: (a := named(p, name)) and a["state"] == "active" and a, 60)
        wait_for("its output", lambda: "started" in p.logs(job["id"]), 30)
        proc.send_signal(sig)
        rc, err = ended(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == code, err
    assert f"cancelled job {job['id']}" in err
    assert p.get(job["id"])["state"] == "cancelled"


def test_a_signal_cancels_a_job_still_waiting(pool: tuple[dict[str, str], Pool]) -> None:
    env, p = pool
    hold = p.http.post("/api/v1/allocations", json={"gpus": 1})  # the only GPU: the run must wait
    assert hold.status_code == 201, hold.text
    proc = start(env, "waiting", "--gpus", "1")
    try:
        job = wait_for("the job to queue", lambda: named(p, "waiting"), 30)
        assert p.get(job["id"])["state"] == "pending"
        proc.send_signal(signal.SIGTERM)
        rc, err = ended(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        p.http.post(f"/api/v1/allocations/{hold.json()['id']}/release")
    assert rc == 143, err
    assert p.get(job["id"])["state"] == "cancelled"


def test_detach_leaves_the_job_running(pool: tuple[dict[str, str], Pool]) -> None:
    env, p = pool
    r = subprocess.run(
        cpool("run", "--detach", "--name", "detached", "--", JOB_PYTHON, "-c", LONG_JOB),
        env=env, cwd=env["PWD"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    job = named(p, "detached")
    assert job is not None
    try:
        wait_for("the detached job to run", lambda: p.get(job["id"])["state"] == "active", 60)
    finally:
        p.http.post(f"/api/v1/allocations/{job['id']}/cancel")


def test_a_reader_gone_cancels_the_job(pool: tuple[dict[str, str], Pool]) -> None:
    """`cpool run … | head -2`: once nothing reads the output, the job is cancelled, quietly."""
    env, p = pool
    loop = "import time\nwhile True:\n    print('line', flush=True)\n    time.sleep(0.1)"
    argv = cpool("run", "--name", "piped", "--", JOB_PYTHON, "-c", loop)
    run = subprocess.Popen(argv, env=env, cwd=env["PWD"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert run.stdout is not None
    try:
        assert run.stdout.readline() == b"line\n"
        run.stdout.close()  # the reader goes away, as `head` does
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    job = named(p, "piped")
    assert job is not None
    assert run.returncode == 128 + signal.SIGPIPE, err
    assert b"Traceback" not in err and b"Broken pipe" not in err, err
    assert p.get(job["id"])["state"] == "cancelled"


def test_no_stdin_leaves_a_piped_stdin_alone(pool: tuple[dict[str, str], Pool]) -> None:
    """`-n`, as with ssh: a script looping over its own input keeps it (the job reads nothing)."""
    env, p = pool
    argv = cpool("run", "-n", "--", JOB_PYTHON, "-c", "import sys; print(repr(sys.stdin.read()))")
    with subprocess.Popen(
        ["sh", "-c", '"$@"; cat', "sh", *argv],
        env=env,
        cwd=env["PWD"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        out, err = proc.communicate("rest of the input\n", timeout=120)
    assert proc.returncode == 0, err
    assert out == "''\nrest of the input\n", out
