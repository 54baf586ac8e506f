"""The pool end to end, as a user runs it: `cpool up`, jobs on a simulated GPU, agent and server outages."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from e2e_helpers import (
    Pool,
    alive,
    child_env,
    cpool,
    free_port,
    job_pid,
    sleeper,
    stop,
    wait_for,
)


@dataclass
class Up:
    proc: subprocess.Popen[bytes]
    pool: Pool
    data: Path
    port: int
    log: Path

    @property
    def agent_dir(self) -> Path:
        return self.data / "agent"

    def agent_pid(self) -> int | None:
        for child in psutil.Process(self.proc.pid).children():
            try:
                if "agent" in child.cmdline():
                    return child.pid
            except psutil.Error:
                continue
        return None

    def output(self) -> str:
        agent_log = self.data / "logs" / "agent.log"
        return (
            self.log.read_text() + "\n--- agent.log\n" + (agent_log.read_text() if agent_log.exists() else "")
        )


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    data, port, log = tmp_path / "pool", free_port(), tmp_path / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cpool("up", "--simulate", "1xA100-80GB", "--data-dir", str(data), "--port", str(port)),
            stdout=out, stderr=subprocess.STDOUT, env=child_env(),
        )  # fmt: skip
    try:
        wait_for("cpool up", lambda: "ComputePool is up" in log.read_text(), 60, log.read_text)
        pool = Pool(f"https://127.0.0.1:{port}", data)
        u = Up(proc, pool, data, port, log)
        wait_for("the local node", lambda: [n["state"] for n in pool.nodes()] == ["ready"], 30, u.output)
        yield u
        pool.close()
    finally:
        stop(proc, signal.SIGINT, timeout=40)


def test_up_runs_jobs_shares_the_gpu_and_readopts_after_an_agent_crash(up: Up) -> None:
    pool = up.pool
    text = up.log.read_text()
    assert f"API https://127.0.0.1:{up.port}" in text
    server, ca = f"CPOOL_SERVER=https://127.0.0.1:{up.port}", f"CPOOL_CA={up.data}/tls/cert.pem"
    assert f"export {server} {ca} CPOOL_TOKEN=$(cat {up.data}/admin-token)" in text
    busy = subprocess.run(
        cpool("up", "--data-dir", str(up.data / "other"), "--port", str(up.port)),
        capture_output=True, text=True, env=child_env(), timeout=30,
    )  # fmt: skip
    assert busy.returncode != 0 and "already in use" in busy.stderr and "Traceback" not in busy.stderr

    # a job runs, its output reaches the log, its exit code its state
    hello = pool.job("print('hello'); import sys; sys.exit(3)", gpus=1, gpu_milli=500)
    wait_for("the job to fail", lambda: pool.state(hello) == "failed", 30, up.output)
    assert pool.get(hello)["exit_code"] == 3
    assert "hello" in pool.logs(hello)

    # two half-GPU jobs share the one device while a third waits
    a = pool.job(sleeper(15, "a-done"), gpus=1, gpu_milli=500)  # outlives the agent restart below
    b = pool.job(sleeper(120), gpus=1, gpu_milli=500)
    wait_for("a and b active", lambda: pool.state(a) == pool.state(b) == "active", 30, up.output)
    c = pool.job(sleeper(120), gpus=1, gpu_milli=500)
    assert {s["device_index"] for s in pool.get(a)["slices"] + pool.get(b)["slices"]} == {0}
    pid_a = wait_for("a's pid", lambda: job_pid(up.agent_dir, a))
    pid_b = wait_for("b's pid", lambda: job_pid(up.agent_dir, b))
    wait_for(
        "the simulated GPU to show both jobs",
        lambda: pool.nodes()[0]["devices"][0]["utilization_pct"] == 100.0,
        detail=lambda: str(pool.nodes()),
    )
    assert pool.state(c) == "pending"

    # kill -9 the agent: `cpool up` starts it again and it re-adopts the jobs, not restarts them
    old_agent = up.agent_pid()
    assert old_agent is not None
    os.kill(old_agent, signal.SIGKILL)
    wait_for("a new agent", lambda: up.agent_pid() not in (None, old_agent), 30, up.output)
    wait_for("re-adoption", lambda: "re-adopted 2 running job(s)" in up.output(), 30, up.output)
    assert alive(pid_a) and alive(pid_b)
    assert (job_pid(up.agent_dir, a), job_pid(up.agent_dir, b)) == (pid_a, pid_b)
    assert not (up.agent_dir / "runs" / str(a) / "2").exists()

    # the re-adopted job's end is reported; its half of the GPU goes to the one that waited
    wait_for("a released", lambda: pool.state(a) == "released", 30, up.output)
    assert pool.get(a)["attempt"] == 1 and pool.get(a)["exit_code"] == 0
    assert "a-done" in pool.logs(a)
    wait_for("c active", lambda: pool.state(c) == "active", 30, up.output)
    pid_c = wait_for("c's pid", lambda: job_pid(up.agent_dir, c))

    # cancelled allocations are no longer assigned: the agent stops their processes
    for alloc in (b, c):
        assert pool.http.post(f"/api/v1/allocations/{alloc}/cancel").status_code == 200
    wait_for("b and c stopped", lambda: not alive(pid_b) and not alive(pid_c), 30, up.output)
    # the sandbox's init and wrapper end just after the job's own process: the record follows
    wait_for("the stop recorded", lambda: "no longer assigned to this node" in up.output(), 30, up.output)

    # Ctrl-C stops both children cleanly
    children = psutil.Process(up.proc.pid).children()
    assert stop(up.proc, signal.SIGINT, timeout=40) == 0
    assert "ComputePool stopped" in up.log.read_text()
    assert not any(alive(ch.pid) for ch in children)

    # running it again reuses the state: same database and token, the agent keeps its credential
    again_log = up.log.with_name("again.log")
    with again_log.open("wb") as out:
        again = subprocess.Popen(
            cpool("up", "--simulate", "1xA100-80GB", "--data-dir", str(up.data), "--port", str(up.port)),
            stdout=out, stderr=subprocess.STDOUT, env=child_env(),
        )  # fmt: skip
    try:
        # its Ctrl-C handler is in place once it says so (a SIGINT before that, from a harness that
        # ignores SIGINT, would be lost and the stop below would wait out its whole timeout)
        said = again_log.read_text
        wait_for("cpool up again", lambda: "ComputePool is up" in said(), 60, said)
        pool2 = Pool(pool.url, up.data)
        wait_for("the pool again", lambda: [n["state"] for n in pool2.nodes()] == ["ready"], 60, up.output)
        assert pool2.state(a) == "released"
        assert up.output().count("joined the pool") == 1
        pool2.close()
    finally:
        assert stop(again, signal.SIGINT, timeout=40) == 0


def test_a_stopped_control_plane_does_not_stop_a_running_job(tmp_path: Path) -> None:
    data, port = tmp_path / "srv", free_port()
    url = f"http://127.0.0.1:{port}"
    server_cmd = cpool("server", "--data-dir", str(data), "--port", str(port))

    def start_server() -> subprocess.Popen[bytes]:
        with (tmp_path / "server.log").open("ab") as out:
            return subprocess.Popen(server_cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env())

    server = start_server()
    agent: subprocess.Popen[bytes] | None = None
    try:
        wait_for("the server", lambda: (data / "admin-token").exists() and Pool(url, data).ready(), 30)
        pool = Pool(url, data)
        token = pool.http.post("/api/v1/join-tokens", json={}).json()["token"]
        agent_dir = tmp_path / "agent"
        agent_log = tmp_path / "agent.log"
        with agent_log.open("wb") as out:
            agent = subprocess.Popen(
                cpool("agent", "--server", url, "--data-dir", str(agent_dir), "--simulate", "1xT4-16GB",
                      "--name", "outage-node", "--poll-wait-s", "3"),  # a long poll delays the server's stop
                stdout=out, stderr=subprocess.STDOUT, env={**child_env(), "CPOOL_JOIN_TOKEN": token},
            )  # fmt: skip
        wait_for(
            "the node", lambda: [n["name"] for n in pool.nodes()] == ["outage-node"], 30, agent_log.read_text
        )

        job = pool.job(sleeper(6, "finished while the server was away"), gpus=1)
        wait_for("the job active", lambda: pool.state(job) == "active", 30, agent_log.read_text)
        pid = wait_for("the job's pid", lambda: job_pid(agent_dir, job))
        pool.close()

        stop(server)
        wait_for("the job to finish without the server", lambda: not alive(pid), 30, agent_log.read_text)
        assert agent.poll() is None, agent_log.read_text()
        assert "control plane unreachable" in agent_log.read_text()

        server = start_server()
        wait_for("the server again", lambda: Pool(url, data).ready(), 30)
        pool = Pool(url, data)
        wait_for("the end reported", lambda: pool.state(job) == "released", 40, agent_log.read_text)
        assert pool.get(job)["exit_code"] == 0
        assert "finished while the server was away" in pool.logs(job)
        pool.close()
    finally:
        if agent is not None:
            assert stop(agent) == 0
        stop(server)
