"""A control plane that restarts or loses a replica, as its users see it: `cpool run` following a
job ends with the job's own exit code, and an agent goes on through another replica (one it was
given, or one the control plane told it about) with its jobs running."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from e2e_helpers import (
    JOB_PYTHON,
    Pool,
    child_env,
    cpool,
    free_port,
    job_readable_dir,
    kill_jobs_under,
    stop,
    wait_for,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
from harness import PgServer  # noqa: E402
from server_fixtures import postgres  # noqa: E402, F401 - the fixture

EXIT = 7  # the job's own exit code: neither the 0 nor the 1 a follower could make up


@pytest.fixture
def gate() -> Iterator[Path]:
    """A folder the job can read (its sandbox has a /tmp and /var/tmp of its own): the job ends
    once `go` appears."""
    folder = job_readable_dir() / f"cpool-follow-{uuid.uuid4().hex[:12]}"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    try:
        yield folder
    finally:
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()


def _job(gate: Path) -> list[str]:
    code = (
        "import os, sys, time\n"
        "print('job started', flush=True)\n"
        f"while not os.path.exists({str(gate / 'go')!r}): time.sleep(0.2)\n"
        "print('job ending', flush=True)\n"
        f"sys.exit({EXIT})\n"
    )
    return [JOB_PYTHON, "-c", code]


def _start_server(data: Path, port: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            cpool("server", "--data-dir", str(data), "--port", str(port), *extra),
            stdout=out, stderr=subprocess.STDOUT, env=child_env(),
        )  # fmt: skip


@contextmanager
def _server(data: Path, port: int, log: Path, *extra: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = _start_server(data, port, log, *extra)
    try:
        yield proc
    finally:
        stop(proc)


def _agent(tmp: Path, token: str, servers: list[str], name: str) -> subprocess.Popen[bytes]:
    flags = [arg for url in servers for arg in ("--server", url)]
    with (tmp / "agent.log").open("ab") as out:
        return subprocess.Popen(
            cpool("agent", *flags, "--data-dir", str(tmp / "agent"), "--simulate", "1xT4-16GB",
                  "--name", name, "--poll-wait-s", "3"),
            stdout=out, stderr=subprocess.STDOUT, env={**child_env(), "CPOOL_JOIN_TOKEN": token},
        )  # fmt: skip


def _follow(tmp: Path, servers: str, token: str, gate: Path) -> subprocess.Popen[str]:
    env = {**child_env(), "CPOOL_SERVER": servers, "CPOOL_TOKEN": token}
    return subprocess.Popen(
        cpool("run", "--no-code", "--cpus", "0.5", "--", *_job(gate)),
        stdout=(tmp / "run.out").open("w"), stderr=(tmp / "run.err").open("w"), text=True, env=env,
    )  # fmt: skip


def _run_output(tmp: Path) -> str:
    return (tmp / "run.out").read_text() + "\n--- stderr\n" + (tmp / "run.err").read_text()


def test_cpool_run_ends_with_the_jobs_code_through_a_restart(tmp_path: Path, gate: Path) -> None:
    data, port = tmp_path / "srv", free_port()
    url = f"http://127.0.0.1:{port}"
    agent = run = logs = None
    server = _start_server(data, port, tmp_path / "server.log")
    try:
        wait_for("the server", lambda: (data / "admin-token").exists() and Pool(url, data).ready(), 30)
        pool = Pool(url, data)
        token = (data / "admin-token").read_text().strip()
        agent = _agent(tmp_path, pool.http.post("/api/v1/join-tokens", json={}).json()["token"], [url], "rs1")
        wait_for("the node", lambda: [n["state"] for n in pool.nodes()] == ["ready"], 30)
        pool.close()

        run = _follow(tmp_path, url, token, gate)
        out = lambda: _run_output(tmp_path)  # noqa: E731
        wait_for("the job's first line", lambda: "job started" in out(), 60, out)
        job = re.findall(r"job (\d+)", (tmp_path / "run.err").read_text())[0]
        logs = subprocess.Popen(
            cpool("logs", "-f", job), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**child_env(), "CPOOL_SERVER": url, "CPOOL_TOKEN": token},
        )  # fmt: skip

        server.send_signal(signal.SIGKILL)  # the control plane dies under its followers
        server.wait(timeout=10)
        wait_for("the follower to notice", lambda: "cannot reach" in out() or run.poll() is not None, 30, out)
        assert run.poll() is None, out()
        (gate / "go").touch()  # the job ends while the control plane is away

        server = _start_server(data, port, tmp_path / "server.log")
        wait_for("the server again", lambda: Pool(url, data).ready(), 30)
        assert run.wait(timeout=120) == EXIT, out()
        assert "job ending" in out()
        followed, said = logs.communicate(timeout=120)
        assert logs.returncode == EXIT and "job ending" in followed, followed + said
    finally:
        for p in (run, logs):
            if p is not None and p.poll() is None:
                p.kill()
        if agent is not None:
            stop(agent)
        stop(server)
        kill_jobs_under(tmp_path)


@pytest.mark.parametrize("given", ["both", "one"])
def test_an_agent_goes_on_through_another_replica(
    postgres: PgServer,  # noqa: F811 - the fixture
    tmp_path: Path,
    gate: Path,
    given: str,
) -> None:
    db = postgres.new_database()
    pa, pb = free_port(), free_port()
    a, b = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
    agent = run = None
    with _server(tmp_path / "a", pa, tmp_path / "a.log", "--db", db) as first:
        admin = tmp_path / "a"  # where the pool's first admin token is written (once, by a)
        wait_for("replica a", lambda: (admin / "admin-token").exists() and Pool(a, admin).ready(), 30)
        token = (admin / "admin-token").read_text().strip()
        with _server(tmp_path / "b", pb, tmp_path / "b.log", "--db", db):
            try:
                wait_for("replica b", lambda: Pool(b, admin).ready(), 30)
                pool_a, pool_b = Pool(a, admin), Pool(b, admin)
                join = pool_a.http.post("/api/v1/join-tokens", json={}).json()["token"]
                name = f"rs-{given}"
                agent = _agent(tmp_path, join, [a, b] if given == "both" else [a], name)
                log = (tmp_path / "agent.log").read_text
                wait_for("the node", lambda: [n["state"] for n in pool_b.nodes()] == ["ready"], 30, log)
                if given == "one":  # it learns replica b from the control plane
                    wait_for("the agent to learn b", lambda: b in log(), 30, log)

                run = _follow(tmp_path, f"{a},{b}", token, gate)
                out = lambda: _run_output(tmp_path)  # noqa: E731
                wait_for("the job's first line", lambda: "job started" in out(), 60, out)
                job = int(re.findall(r"job (\d+)", (tmp_path / "run.err").read_text())[0])

                first.send_signal(signal.SIGKILL)  # the replica the agent and the follower use
                first.wait(timeout=10)
                (gate / "go").touch()
                assert run.wait(timeout=180) == EXIT, out() + "\n--- agent\n" + log()
                got = pool_b.get(job)
                assert (got["state"], got["exit_code"]) == ("failed", EXIT), got  # its own exit, recorded
                assert [n["state"] for n in pool_b.nodes()] == ["ready"], log()
                assert agent.poll() is None, log()
                pool_a.close()
                pool_b.close()
            finally:
                if run is not None and run.poll() is None:
                    run.kill()
                if agent is not None:
                    stop(agent)
                kill_jobs_under(tmp_path)
