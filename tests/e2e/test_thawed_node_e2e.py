"""A node frozen and thawed runs nothing it no longer owns: real `cpool server` and `cpool agent`
processes on loopback, frozen with SIGSTOP (the agent alone, or the agent with its supervisors and
jobs) past the pool's lost-node time of 6 s, and thawed. The process table is read every ~50 ms.

- a restartable job that handles SIGTERM, frozen with its node while the pool runs attempt 2
  elsewhere, is killed at once on the thaw: no SIGTERM, so its handler never runs beside attempt 2;
- an assignments answer that sat in the frozen agent's socket is refused, not obeyed;
- a node that rejoins stops the job it no longer owns, and sees it dead, before it starts the
  next one on the same device."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from e2e_helpers import JOB_PYTHON, Pool, alive, child_env, cpool, wait_for
from test_one_copy_e2e import Cluster, command, started_cluster

from computepool.agent.api import load_credential
from computepool.agent.executor import STDOUT_LOG

# prints "up", then on SIGTERM prints "TERM" and runs on (a job that checkpoints on SIGTERM)
HANDLER = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: print('TERM', flush=True))\n"
    "print('up', flush=True)\n"
    "while True:\n"
    "    time.sleep(0.05)\n"
)
BASE = {"cpu_milli": 100, "memory_mib": 64}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    yield from started_cluster(tmp_path)


@pytest.fixture
def frozen() -> Iterator[list[psutil.Process]]:
    """The processes a test froze; thawed at the end whatever happened (before the cluster stops)."""
    out: list[psutil.Process] = []
    yield out
    thaw(out)


class Sampler:
    """Reads the process table every ~50 ms: the running (not stopped, not zombie) pids of each
    command, and the most of all the commands' copies seen running in one read."""

    def __init__(self, *cmds: list[str]) -> None:
        self.cmds = [list(c) for c in cmds]
        self.seen: list[list[int]] = [[] for _ in cmds]  # running pids, in the order first seen
        self.max_together = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            running: list[set[int]] = [set() for _ in self.cmds]
            for p in psutil.process_iter(["cmdline", "status"]):
                if p.info["status"] in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
                    continue
                for i, c in enumerate(self.cmds):
                    if p.info["cmdline"] == c:
                        running[i].add(p.pid)
            for i, pids in enumerate(running):
                self.seen[i] += sorted(pids - set(self.seen[i]))
            self.max_together = max(self.max_together, sum(len(r) for r in running))
            self._stop.wait(0.05)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)


def freeze(root_pid: int, frozen: list[psutil.Process], with_children: bool) -> list[psutil.Process]:
    """SIGSTOP the agent, then (with_children) everything under it, until nothing new appears."""
    root = psutil.Process(root_pid)
    root.send_signal(signal.SIGSTOP)
    frozen.append(root)
    while with_children:
        new = [p for p in root.children(recursive=True) if p.pid not in {f.pid for f in frozen}]
        if not new:
            break
        for p in new:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGSTOP)
                frozen.append(p)
    wait_for("all frozen", lambda: all(_stopped(p) for p in frozen), 10)
    return list(frozen)


def _stopped(p: psutil.Process) -> bool:
    try:
        return p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def thaw(frozen: list[psutil.Process]) -> None:
    """SIGCONT to all, the agent and its supervisors first, at once, as a node's thaw."""
    first = [p for p in frozen if p is frozen[0] or _is_supervisor(p)]
    for p in first + [p for p in frozen if p not in first]:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGCONT)
    frozen.clear()


def _is_supervisor(p: psutil.Process) -> bool:
    try:
        return "computepool.agent.fencing" in p.cmdline()
    except psutil.Error:
        return False


def start_agent(cluster: Cluster, name: str, kill_grace_s: float) -> None:
    """As Cluster.start_agent, with a kill grace of the test's choosing."""
    cmd = cpool("agent", "--server", cluster.url, "--join-token", cluster.token, "--name", name)
    cmd += ["--data-dir", str(cluster.root / name), "--simulate", "1xT4-16GB"]
    cmd += ["--kill-grace-s", str(kill_grace_s)]
    with (cluster.root / f"{name}.log").open("ab") as out:
        cluster.agents[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env())
    wait_for(f"node {name} ready", lambda: _node_state(cluster, name) == "ready", 30, detail=cluster.logs)


def _on(pool: Pool, alloc_id: int, attempt: int, node: str) -> bool:
    a = pool.get(alloc_id)
    return bool(a["attempt"] == attempt and a["state"] == "active" and a["nodes"] == [node])


def _node_state(cluster: Cluster, name: str) -> str:
    assert cluster.pool is not None
    return next((str(n["state"]) for n in cluster.pool.nodes() if n["name"] == name), "")


def _agent_log(cluster: Cluster, name: str) -> str:
    return (cluster.root / f"{name}.log").read_text()


def test_a_thawed_node_kills_its_fenced_copy_at_once_without_sigterm(
    cluster: Cluster, frozen: list[psutil.Process]
) -> None:
    pool = cluster.pool
    assert pool is not None
    cluster.start_agent("node-a")
    job = [JOB_PYTHON, "-c", HANDLER, f"handler-{uuid.uuid4().hex[:8]}"]
    r = pool.http.post("/api/v1/allocations", json={**BASE, "command": job, "restartable": True})
    assert r.status_code == 201, r.text
    alloc_id = int(r.json()["id"])
    wait_for("attempt 1 on node-a", lambda: _on(pool, alloc_id, 1, "node-a"), 30, detail=cluster.logs)
    cluster.start_agent("node-b")  # somewhere to move to, only now
    first_out = cluster.root / "node-a" / "runs" / str(alloc_id) / "1" / STDOUT_LOG
    with Sampler(job) as s:
        wait_for("the first copy up", lambda: s.seen[0] and "up" in first_out.read_text(), 30)
        [first] = s.seen[0]
        node = freeze(cluster.agents["node-a"].pid, frozen, with_children=True)
        assert any(_is_supervisor(p) for p in node), "the job's fence supervisor was not frozen"
        assert any(p.pid == first for p in node)
        wait_for("attempt 2 on node-b", lambda: _on(pool, alloc_id, 2, "node-b"), 40, detail=cluster.logs)
        wait_for("the second copy running", lambda: len(s.seen[0]) == 2, 20)
        second = s.seen[0][1]
        thaw(frozen)  # the frozen copy's deadline and grace are long past
        wait_for("the first copy gone", lambda: not alive(first), 30, detail=cluster.logs)
    out = first_out.read_text()
    assert "TERM" not in out, "the thawed copy got SIGTERM and ran its handler beside attempt 2"
    assert alive(second) and _on(pool, alloc_id, 2, "node-b")
    wait_for("node-a back", lambda: _node_state(cluster, "node-a") == "ready", 30, detail=cluster.logs)
    assert pool.http.post(f"/api/v1/allocations/{alloc_id}/cancel").status_code == 200
    wait_for("the second copy stopped", lambda: not alive(second), 20)


def test_an_answer_held_in_a_frozen_agents_socket_is_refused(
    cluster: Cluster, frozen: list[psutil.Process]
) -> None:
    pool = cluster.pool
    assert pool is not None
    cluster.start_agent("node-a")
    job = command(f"stale-{uuid.uuid4().hex[:8]}")
    first_poll = '"GET /api/v1/nodes/node-a/assignments?wait='
    wait_for(
        "the agent's first poll answered", lambda: first_poll in (cluster.root / "server.log").read_text()
    )
    time.sleep(1.0)  # it polls again at once, and waits for a change
    with Sampler(job) as s:
        freeze(cluster.agents["node-a"].pid, frozen, with_children=False)  # its long poll stays open
        r = pool.http.post("/api/v1/allocations", json={**BASE, "command": job})
        assert r.status_code == 201, r.text
        alloc_id = int(r.json()["id"])
        wait_for(
            "bound to node-a", lambda: pool.get(alloc_id)["nodes"] == ["node-a"], 30, detail=cluster.logs
        )
        # the pool answers the frozen agent's poll with it, then fails it: the answer waits in the socket
        assert pool.http.post(f"/api/v1/allocations/{alloc_id}/cancel").status_code == 200
        wait_for("node-a lost", lambda: _node_state(cluster, "node-a") == "lost", 30, detail=cluster.logs)
        thaw(frozen)
        wait_for(
            "the held answer refused",
            lambda: "refusing an assignments answer" in _agent_log(cluster, "node-a"),
            30,
            detail=cluster.logs,
        )
        wait_for("node-a back", lambda: _node_state(cluster, "node-a") == "ready", 30, detail=cluster.logs)
        ended = cluster.root / "node-a" / "runs" / str(alloc_id)
    assert f"{alloc_id}#1 started" not in _agent_log(cluster, "node-a"), cluster.logs()
    assert s.seen[0] == [], "the agent started a job the pool had cancelled"
    assert not ended.exists(), "the agent began an attempt the pool had cancelled"
    assert pool.state(alloc_id) == "cancelled"


def test_a_rejoining_node_stops_old_work_before_new_work_starts_on_its_device(
    cluster: Cluster, frozen: list[psutil.Process]
) -> None:
    pool = cluster.pool
    assert pool is not None
    start_agent(cluster, "node-a", kill_grace_s=120)  # a stop that takes its time
    tag = uuid.uuid4().hex[:8]
    old, new = command(f"old-{tag}"), command(f"new-{tag}")  # both end on SIGTERM
    r = pool.http.post("/api/v1/allocations", json={**BASE, "gpus": 1, "command": old})
    assert r.status_code == 201, r.text
    old_id = int(r.json()["id"])
    wait_for("the old job on node-a", lambda: _on(pool, old_id, 1, "node-a"), 30, detail=cluster.logs)
    with Sampler(old, new) as s:
        wait_for("the old job running", lambda: s.seen[0], 30)
        [old_pid] = s.seen[0]
        node = freeze(cluster.agents["node-a"].pid, frozen, with_children=True)
        wait_for("the old job failed with its node", lambda: pool.state(old_id) == "failed", 30)
        r = pool.http.post("/api/v1/allocations", json={**BASE, "gpus": 1, "command": new})
        assert r.status_code == 201, r.text
        new_id = int(r.json()["id"])
        frozen.remove(node[0])
        thaw([node[0]])  # the agent is back; its old job stays stuck a while, still on the device
        waits = f"{new_id}#1 waits for {old_id}#1 to end"
        wait_for(
            "the new job held back", lambda: waits in _agent_log(cluster, "node-a"), 40, detail=cluster.logs
        )
        assert alive(old_pid) and not s.seen[1]
        thaw(frozen)  # the old job comes unstuck and ends on the SIGTERM it was sent
        wait_for("the new job on node-a", lambda: _on(pool, new_id, 1, "node-a"), 40, detail=cluster.logs)
        wait_for("the new job running", lambda: s.seen[1], 20, detail=cluster.logs)
        assert not alive(old_pid)
    ended = f"{old_id}#1 ended"
    log = _agent_log(cluster, "node-a")  # the old job seen dead before the new one started
    assert log.index(ended) < log.index(f"{new_id}#1 started"), log
    assert s.max_together == 1, "the old and the new job ran at once on one device"
    assert pool.http.post(f"/api/v1/allocations/{new_id}/cancel").status_code == 200
    wait_for("the new job stopped", lambda: not any(alive(p) for p in s.seen[1]), 20)


def test_the_server_says_how_long_it_held_a_poll_never_more_than_it_took(cluster: Cluster) -> None:
    cluster.start_agent("node-a")
    # The server marks the node ready when it answers the registration; the agent writes the
    # credential it was given a moment later.
    wait_for("the agent's credential", lambda: load_credential(cluster.root / "node-a") is not None, 30)
    cred = load_credential(cluster.root / "node-a")
    assert cred is not None
    url = f"{cluster.url}/api/v1/nodes/node-a/assignments"
    headers = {"Authorization": f"Bearer {cred.credential}"}
    first = httpx.get(url, headers=headers, timeout=10)
    assert first.status_code == 200, first.text
    assert first.json()["held_s"] >= 0
    t0 = time.monotonic()
    held = httpx.get(url, headers=headers, params={"wait": 1, "since": first.json()["version"]}, timeout=10)
    took = time.monotonic() - t0
    assert held.status_code == 200, held.text
    assert held.json()["version"] == first.json()["version"]  # unchanged: answered when the wait ended
    assert 0 < held.json()["held_s"] <= took  # the agent's bound on an answer's age relies on this
