"""The real `cpool agent` against a real `cpool server` on loopback: join, heartbeat, credential, errors."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import computepool
from computepool.agent.join import tenant_pythons
from computepool.agent.localstate import JobRecord, JobState, LocalState

SRC = str(Path(computepool.__file__).parent.parent)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env() -> dict[str, str]:
    """The children run this checkout's code and never touch the host's cgroups."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))}
    env["CPOOL_CGROUP_BASE"] = "none"
    env.pop("CPOOL_JOIN_TOKEN", None)
    return env


def cpool(*args: str) -> list[str]:
    return [sys.executable, "-m", "computepool.cli.main", *args]


def wait_for(what: str, check: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except (httpx.HTTPError, KeyError, OSError):
            value = None
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


class Server:
    """`cpool server` with short heartbeat thresholds, so readiness can be seen in seconds."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / "server.log"
        cmd = cpool("server", "--data-dir", str(root / "srv"), "--port", str(self.port))
        cmd += ["--heartbeat-s", "0.5", "--suspect-s", "2", "--lost-s", "4"]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env())
        wait_for(
            "the server", lambda: self.proc.poll() is None and httpx.get(f"{self.url}/readyz").is_success, 30
        )
        token = (root / "srv" / "admin-token").read_text().strip()
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)

    def join_token(self, single_use: bool = True) -> str:
        r = self.http.post("/api/v1/join-tokens", json={"single_use": single_use})
        assert r.status_code == 201, r.text
        return str(r.json()["token"])

    def node(self, name: str) -> dict[str, Any] | None:
        r = self.http.get(f"/api/v1/nodes/{name}")
        return r.json() if r.status_code == 200 else None

    def close(self) -> None:
        self.http.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(3)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)  # uvicorn's force quit: long polls still open end now
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("pool"))
    yield s
    s.close()


def start_agent(
    server: Server, data_dir: Path, *args: str, token: str | None = None
) -> subprocess.Popen[str]:
    cmd = cpool("agent", "--server", server.url, "--data-dir", str(data_dir), *args)
    env = child_env()
    if token:
        env["CPOOL_JOIN_TOKEN"] = token  # not on the command line, where `ps` would show it
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def stop_agent(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=15)
    return proc.returncode, out


def run_agent_once(server: Server, data_dir: Path, *args: str, token: str | None = None) -> tuple[int, str]:
    proc = start_agent(server, data_dir, *args, token=token)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"the agent did not exit:\n{out}") from None
    return proc.returncode, out


def test_agent_joins_heartbeats_and_reuses_its_credential(server: Server, tmp_path: Path) -> None:
    data = tmp_path / "agent"
    agent = start_agent(server, data, "--simulate", "2xA100-80GB,1xT4-16GB", "--name", "sim-1",
                        token=server.join_token())  # fmt: skip
    try:
        node = wait_for("the node", lambda: server.node("sim-1"))
        assert [(d["index"], d["model"], d["memory_mib"]) for d in node["devices"]] == [
            (0, "A100", 81920),
            (1, "A100", 81920),
            (2, "T4", 16384),
        ]
        assert len({d["uuid"] for d in node["devices"]}) == 3
        # the Pythons a tenant's job can run here, as the agent reported them at its join
        pythons = {f"cpool.io/python-{v}": "yes" for v in tenant_pythons()}
        assert node["labels"] == {"simulated": "true", "cpool.io/node": "sim-1", **pythons}
        assert node["pythons"] == tenant_pythons()
        cred = data / "node.json"  # saved once the join's answer is read: a moment after the server has it
        wait_for("the credential", cred.exists)
        assert stat.S_IMODE(cred.stat().st_mode) == 0o600
        # a root agent lets its sandboxed jobs pass through to their own dirs, never list or read it
        # (the executor sets it as it starts, a moment after the join)
        want = 0o711 if os.geteuid() == 0 else 0o700
        wait_for("the data dir's mode", lambda: stat.S_IMODE(data.stat().st_mode) == want)
        # heartbeats keep it ready well past the suspect age (2 s), with usage filled in
        time.sleep(3)
        node = server.node("sim-1")
        assert node is not None and node["state"] == "ready" and node["heartbeat_age_s"] < 2
        assert all(d["used_memory_mib"] == 0 and d["utilization_pct"] == 0 for d in node["devices"])
    finally:
        rc, out = stop_agent(agent)
    assert rc == 0, out
    assert "stopping the agent; workloads keep running" in out and "Traceback" not in out

    # a restart needs no join token: the credential in the data dir is used, the devices stay the same
    first_seen = server.node("sim-1")
    assert first_seen is not None
    agent = start_agent(server, data)
    try:
        wait_for(
            "a heartbeat from the restarted agent",
            lambda: (n := server.node("sim-1")) and n["last_heartbeat_at"] > first_seen["last_heartbeat_at"],
        )
        nodes = server.http.get("/api/v1/nodes").json()["items"]
        assert [n["name"] for n in nodes].count("sim-1") == 1
    finally:
        rc, out = stop_agent(agent)
    assert rc == 0, out
    assert "joined the pool" not in out

    # the same data dir cannot become another node, nor another set of simulated devices
    rc, out = run_agent_once(server, data, "--name", "other")
    assert rc != 0 and "holds the credential of node 'sim-1'" in out
    rc, out = run_agent_once(server, data, "--simulate", "1xT4-16GB")
    assert rc != 0 and "joined with --simulate 2xA100-80GB,1xT4-16GB" in out


def _one_error_line(out: str) -> str:
    assert "Traceback" not in out, out
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, out
    return errors[0]


def test_bad_join_tokens_and_inputs_give_one_line(server: Server, tmp_path: Path) -> None:
    wrong = server.join_token().split(".")[0] + "." + server.join_token().split(".")[1]  # another's secret
    rc, out = run_agent_once(server, tmp_path / "a1", "--name", "bad-1", token=wrong)
    assert rc != 0 and "not a valid join token" in _one_error_line(out)
    assert not (tmp_path / "a1" / "node.json").exists()

    token = server.join_token(single_use=True)
    ok = start_agent(server, tmp_path / "a2", "--simulate", "1xT4-16GB", "--name", "used-1", token=token)
    try:
        wait_for("the first node", lambda: server.node("used-1"))
    finally:
        stop_agent(ok)
    rc, out = run_agent_once(server, tmp_path / "a3", "--name", "used-2", token=token)
    assert rc != 0 and "used already" in _one_error_line(out)
    assert server.node("used-2") is None

    rc, out = run_agent_once(server, tmp_path / "a4", "--name", "nojoin")
    assert rc != 0 and "no join token" in _one_error_line(out)

    rc, out = run_agent_once(server, tmp_path / "a5", "--simulate", "3xNOPE", token=server.join_token())
    assert rc != 0 and "simulate" in _one_error_line(out)

    dead = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run(
        cpool("agent", "--server", dead, "--data-dir", str(tmp_path / "a6"), "--join-token", "x.y"),
        capture_output=True, text=True, env=child_env(), timeout=30,
    )  # fmt: skip
    assert proc.returncode != 0 and "cannot reach the control plane" in _one_error_line(proc.stderr)


def test_an_agent_forgets_the_ends_the_pool_is_done_with(server: Server, tmp_path: Path) -> None:
    """A node that ran thousands of jobs keeps none of their acknowledged ends: its passes read
    only what runs or is still to report, so it costs the same after 2,000 jobs as after none."""
    data = tmp_path / "agent"
    agent = start_agent(server, data, "--name", "forget-1", token=server.join_token())
    try:
        wait_for("the node", lambda: server.node("forget-1"))
    finally:
        stop_agent(agent)
    state = LocalState(data)
    for i in range(2000):
        run = str(data / "runs" / str(800000 + i) / "1")
        state.put(JobRecord(str(800000 + i), 1, ["true"], run, state=JobState.SUCCEEDED, exit_code=0,
                            started_at=1.0, ended_at=2.0, reported=True, extra={"tenant": "t1"}))  # fmt: skip
    # ran while the agent was away and gone since: reported as lost, then forgotten too
    state.put(JobRecord("799999", 1, ["true"], str(data / "runs/799999/1"), pid=2**22 + 1, create_time=1.0))
    state.close()

    def kept() -> int:
        with contextlib.closing(sqlite3.connect(f"file:{data / 'agent-state.db'}?mode=ro", uri=True)) as db:
            return int(db.execute("SELECT count(*) FROM jobs").fetchone()[0])

    agent = start_agent(server, data, "--poll-wait-s", "1")
    try:
        wait_for("the acknowledged ends to be forgotten", lambda: kept() == 0, 120)  # a busy host: slow
    finally:
        rc, out = stop_agent(agent)
    assert rc == 0 and "Traceback" not in out, out
    assert "799999#1 ended while the agent was away" in out
    state = LocalState(data)
    assert state.tenants() == {"t1"}  # the tenants it served are still known
    state.close()
