"""One copy of a job, ever: real `cpool server` and `cpool agent` processes on loopback.

An agent is killed with SIGKILL (its jobs run on) or loses its control plane; the pool declares
its node lost after 6 s and starts the restartable job again. The process table is read every
~50 ms throughout: at no instant may two copies of that job run, and the first copy must be gone
before the node is declared lost. A job that is not restartable keeps running."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
from e2e_helpers import JOB_PYTHON, Pool, child_env, cpool, free_port, stop, wait_for

LOST_S = 6.0
SERVER_TIMING = ["--heartbeat-s", "0.5", "--suspect-s", "2", "--lost-s", str(LOST_S)]


@dataclass
class Cluster:
    root: Path
    port: int
    server: subprocess.Popen[bytes] | None = None
    agents: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    pool: Pool | None = None
    token: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_server(self) -> None:
        cmd = cpool("server", "--data-dir", str(self.root / "srv"), "--port", str(self.port), *SERVER_TIMING)
        cmd.append("--access-log")  # tests read the agents' polls off server.log
        with (self.root / "server.log").open("ab") as out:
            self.server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env())
        wait_for("the server", lambda: httpx.get(f"{self.url}/readyz", timeout=2).is_success, 30)
        if self.pool is None:
            self.pool = Pool(self.url, self.root / "srv")
            r = self.pool.http.post("/api/v1/join-tokens", json={"single_use": False})
            assert r.status_code == 201, r.text
            self.token = r.json()["token"]

    def start_agent(self, name: str) -> None:
        cmd = cpool("agent", "--server", self.url, "--join-token", self.token, "--name", name)
        cmd += ["--data-dir", str(self.root / name), "--simulate", "1xT4-16GB", "--kill-grace-s", "1"]
        with (self.root / f"{name}.log").open("ab") as out:
            self.agents[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env())
        assert self.pool is not None
        pool = self.pool
        wait_for(
            f"node {name} ready",
            lambda: any(n["name"] == name and n["state"] == "ready" for n in pool.nodes()),
            30,
            detail=lambda: (self.root / f"{name}.log").read_text()[-3000:],
        )

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("*.log")))


def started_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A server on a free port (the test starts the agents); everything stopped afterwards."""
    c = Cluster(tmp_path, free_port())
    c.start_server()
    yield c
    for proc in c.agents.values():
        stop(proc)
    if c.pool is not None:
        c.pool.close()
    if c.server is not None:
        stop(c.server, signal.SIGINT)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    yield from started_cluster(tmp_path)


def command(marker: str) -> list[str]:
    return [JOB_PYTHON, "-c", "import time; time.sleep(600)", marker]


class Watcher:
    """Reads the process table every ~50 ms: which pids run exactly `cmd`, with when each was seen."""

    def __init__(self, *cmds: list[str]) -> None:
        self.cmds = [list(c) for c in cmds]
        self.max_copies = [0] * len(cmds)
        self.first_seen: list[dict[int, float]] = [{} for _ in cmds]
        self.last_seen: list[dict[int, float]] = [{} for _ in cmds]
        self.scans = 0
        self.max_gap = 0.0  # the longest time between two reads of the process table
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            self.max_gap, last = max(self.max_gap, now - last), now
            found: list[set[int]] = [set() for _ in self.cmds]
            for p in psutil.process_iter(["cmdline", "status"]):
                cmdline = p.info["cmdline"]
                if not cmdline or p.info["status"] == psutil.STATUS_ZOMBIE:
                    continue
                for i, c in enumerate(self.cmds):
                    if cmdline == c:
                        found[i].add(p.pid)
            for i, pids in enumerate(found):
                self.max_copies[i] = max(self.max_copies[i], len(pids))
                for pid in pids:
                    self.first_seen[i].setdefault(pid, now)
                    self.last_seen[i][pid] = now
            self.scans += 1
            self._stop.wait(0.05)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def pids(self, i: int) -> list[int]:
        return sorted(self.first_seen[i], key=lambda pid: self.first_seen[i][pid])


def _current(pool: Pool, alloc_id: int, attempt: int, state: str = "active") -> bool:
    a = pool.get(alloc_id)
    return a["attempt"] == attempt and a["state"] == state


def test_a_killed_agent_never_leaves_two_copies_of_a_restartable_job(cluster: Cluster) -> None:
    pool = cluster.pool
    assert pool is not None
    cluster.start_agent("node-a")
    tag = uuid.uuid4().hex[:8]
    mover, stayer = command(f"mover-{tag}"), command(f"stayer-{tag}")
    base = {"cpu_milli": 100, "memory_mib": 64}
    r = pool.http.post("/api/v1/allocations", json={**base, "command": mover, "restartable": True})
    assert r.status_code == 201, r.text
    moving = int(r.json()["id"])
    r = pool.http.post("/api/v1/allocations", json={**base, "command": stayer})
    assert r.status_code == 201, r.text
    staying = int(r.json()["id"])
    for i in (moving, staying):
        wait_for(f"allocation {i} active", lambda i=i: _current(pool, i, 1), 30, detail=cluster.logs)
    cluster.start_agent("node-b")  # somewhere to move to, only now: both jobs run on node-a
    with Watcher(mover, stayer) as w:
        wait_for("both jobs seen", lambda: w.max_copies[0] == 1 and w.max_copies[1] == 1, 10)
        cluster.agents["node-a"].kill()
        killed_at = time.monotonic()
        cluster.agents["node-a"].wait()
        wait_for(
            "the restartable job running again on node-b",
            lambda: _current(pool, moving, 2) and pool.get(moving)["nodes"] == ["node-b"],
            40,
            detail=cluster.logs,
        )
        wait_for("the second copy seen", lambda: len(w.first_seen[0]) == 2, 10)
        time.sleep(0.5)
    assert w.scans > 50 and w.max_gap < 0.5, (w.scans, w.max_gap)
    assert w.max_copies[0] == 1, f"two copies of the restartable job ran at once: {w.first_seen[0]}"
    first, second = w.pids(0)
    assert w.last_seen[0][first] < w.first_seen[0][second]
    assert w.first_seen[0][second] - w.last_seen[0][first] > w.max_gap  # a gap the scans could see
    gone_after = w.last_seen[0][first] - killed_at
    assert gone_after < LOST_S, f"the first copy ran {gone_after:.1f} s after its agent died"
    assert psutil.pid_exists(second)
    events = [e["reason"] for e in pool.get(moving)["events"]]
    assert any("requeued as attempt 2" in e for e in events), events
    # the job that is not restartable kept running, orphaned, and is ended by the pool
    [stayer_pid] = w.pids(1)
    assert psutil.Process(stayer_pid).status() != psutil.STATUS_ZOMBIE
    wait_for("the lost node's other job ended", lambda: pool.state(staying) == "failed", 20)
    psutil.Process(stayer_pid).kill()  # orphaned on purpose; this test started it
    r = pool.http.post(f"/api/v1/allocations/{moving}/cancel")
    assert r.status_code == 200, r.text
    wait_for("the second copy stopped", lambda: not psutil.pid_exists(second), 20)


def test_an_agent_cut_off_from_the_control_plane_fences_restartable_work_itself(cluster: Cluster) -> None:
    pool = cluster.pool
    assert pool is not None
    cluster.start_agent("node-a")
    tag = uuid.uuid4().hex[:8]
    mover, stayer = command(f"mover-{tag}"), command(f"stayer-{tag}")
    base = {"cpu_milli": 100, "memory_mib": 64}
    r = pool.http.post("/api/v1/allocations", json={**base, "command": mover, "restartable": True})
    moving = int(r.json()["id"])
    r = pool.http.post("/api/v1/allocations", json={**base, "command": stayer})
    staying = int(r.json()["id"])
    for i in (moving, staying):
        wait_for(f"allocation {i} active", lambda i=i: _current(pool, i, 1), 30, detail=cluster.logs)
    with Watcher(mover, stayer) as w:
        wait_for("both jobs seen", lambda: w.max_copies[0] == 1 and w.max_copies[1] == 1, 10)
        assert cluster.server is not None
        cluster.server.kill()  # a crash: nothing on the server's side moves meanwhile
        cluster.server.wait()
        away_at = time.monotonic()
        [first] = w.pids(0)
        wait_for("the restartable job fenced", lambda: not psutil.pid_exists(first), LOST_S + 5)
        fenced_after = time.monotonic() - away_at
        assert cluster.agents["node-a"].poll() is None, "the agent itself stays up"
        [stayer_pid] = w.pids(1)
        assert psutil.pid_exists(stayer_pid), "work that is not restartable keeps running"
        cluster.start_server()
        wait_for("attempt 2 running", lambda: _current(pool, moving, 2), 40, detail=cluster.logs)
        wait_for("the second copy seen", lambda: len(w.first_seen[0]) == 2, 10)
    assert fenced_after < LOST_S
    assert w.max_copies[0] == 1
    reasons = " | ".join(e["reason"] for e in pool.get(moving)["events"])
    assert "requeued as attempt 2" in reasons, reasons
    for i in (staying, moving):
        pool.http.post(f"/api/v1/allocations/{i}/cancel")
    wait_for("the jobs stopped", lambda: not any(psutil.pid_exists(p) for p in w.pids(1) + w.pids(0)), 20)


def test_an_agent_whose_fence_could_let_two_copies_run_refuses_to_start(cluster: Cluster) -> None:
    cmd = cpool("agent", "--server", cluster.url, "--join-token", cluster.token, "--name", "node-x")
    cmd += ["--data-dir", str(cluster.root / "node-x"), "--simulate", "1xT4-16GB", "--fence-s", "5.5"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=60)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "fence 5.5 s" in last and "lost-node timeout 6 s" in last and "--fence-s" in last, done.stderr
    assert "Traceback" not in done.stderr


def test_a_time_limit_stops_the_job_on_its_node(cluster: Cluster) -> None:
    pool = cluster.pool
    assert pool is not None
    cluster.start_agent("node-a")
    job = command(f"limited-{uuid.uuid4().hex[:8]}")
    body = {"cpu_milli": 100, "memory_mib": 64, "command": job, "restartable": True, "time_limit": "2s"}
    r = pool.http.post("/api/v1/allocations", json=body)
    assert r.status_code == 201, r.text
    alloc_id = int(r.json()["id"])
    with Watcher(job) as w:
        wait_for("the job running", lambda: w.max_copies[0] == 1, 30, detail=cluster.logs)
        wait_for("the time limit", lambda: pool.state(alloc_id) == "failed", 20, detail=cluster.logs)
        [pid] = w.pids(0)
        wait_for("the job stopped by its agent", lambda: not psutil.pid_exists(pid), 20, detail=cluster.logs)
    got = pool.get(alloc_id)
    assert got["reason"] == "time limit 2s reached" and got["attempt"] == 1
