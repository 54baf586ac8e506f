"""A gang over two real agents on loopback: `cpool server`, and two `cpool agent`s with their own names,
data dirs and addresses (127.0.0.2 and 127.0.0.3). Each member is told the gang's environment; rank 1
reaches rank 0's rendezvous port; a member that exits 3 fails the gang and the other one is stopped."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import (
    Pool,
    alive,
    child_env,
    cpool,
    free_port,
    job_pid,
    stop,
    wait_for,
)

ADDRESSES = {"gang-a": "127.0.0.2", "gang-b": "127.0.0.3"}
GANG_VARS = (
    "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NNODES", "NODE_RANK",
    "NPROC_PER_NODE", "LOCAL_WORLD_SIZE", "CPOOL_RANK", "CPOOL_PEERS",
)  # fmt: skip

# Each member writes its gang environment into its work dir; rank 1 then connects to the port rank 0
# listens on (MASTER_ADDR:MASTER_PORT) before it exits, so both have surely run.
WRITE_ENV = f"""
import json, os, socket, time
json.dump({{k: os.environ.get(k) for k in {GANG_VARS!r}}}, open("gang-env.json", "w"))
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
if os.environ["NODE_RANK"] == "0":
    srv = socket.create_server((addr, port))
    srv.settimeout(60)
    conn, peer = srv.accept()
    print("rank 0 met", peer[0], flush=True)
else:
    for _ in range(600):
        try:
            socket.create_connection((addr, port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    else:
        raise SystemExit("rank 0 never listened")
"""

# Rank 0 sleeps; rank 1 waits until rank 0 listens, then exits 3.
ONE_FAILS = """
import os, socket, sys, time
with open("job.pid.new", "w") as f:
    f.write(str(os.getpid()))
os.replace("job.pid.new", "job.pid")  # never seen half written
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
if os.environ["NODE_RANK"] == "0":
    srv = socket.create_server((addr, port))
    time.sleep(300)
for _ in range(600):
    try:
        socket.create_connection((addr, port), timeout=1).close()
        break
    except OSError:
        time.sleep(0.1)
for _ in range(3000):  # the test found rank 0's pid: it writes "go" here
    if os.path.exists("go"):
        break
    time.sleep(0.1)
sys.exit(3)
"""


@dataclass
class Gangs:
    root: Path
    port: int = field(default_factory=free_port)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    pool: Pool | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("*.log")))

    def env(self) -> dict[str, str]:
        token = (self.root / "srv" / "admin-token").read_text().strip()
        return {**child_env(), "CPOOL_SERVER": self.url, "CPOOL_TOKEN": token}

    def api(self) -> Pool:
        assert self.pool is not None
        return self.pool

    def work_file(self, node: str, alloc_id: int, name: str) -> Path:
        return self.root / node / "runs" / str(alloc_id) / "1" / "work" / name


def _ready(pool: Pool, name: str) -> bool:
    return any(n["name"] == name and n["state"] == "ready" for n in pool.nodes())


@pytest.fixture(scope="module")
def gangs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gangs]:
    g = Gangs(tmp_path_factory.mktemp("gangs"))
    cmd = cpool("server", "--data-dir", str(g.root / "srv"), "--port", str(g.port))
    try:
        with (g.root / "server.log").open("ab") as out:
            g.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env()))
        wait_for("the server", lambda: httpx.get(f"{g.url}/readyz", timeout=2).is_success, 30, g.logs)
        g.pool = Pool(g.url, g.root / "srv")
        token = g.pool.http.post("/api/v1/join-tokens", json={"single_use": False}).json()["token"]
        for name, address in ADDRESSES.items():
            cmd = cpool("agent", "--server", g.url, "--join-token", token, "--name", name)
            cmd += ["--data-dir", str(g.root / name), "--address", address, "--kill-grace-s", "1"]
            with (g.root / f"{name}.log").open("ab") as out:
                g.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env()))
            wait_for(f"node {name} ready", partial(_ready, g.pool, name), 30, g.logs)
        yield g
    finally:
        for p in reversed(g.procs):
            stop(p, signal.SIGTERM)
        if g.pool is not None:
            g.pool.close()


def test_nodes_show_the_addresses_their_agents_gave(gangs: Gangs) -> None:
    assert {n["name"]: n["address"] for n in gangs.api().nodes()} == ADDRESSES
    shown = subprocess.run(cpool("nodes"), capture_output=True, text=True, env=gangs.env(), timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "127.0.0.2" in shown.stdout and "127.0.0.3" in shown.stdout


def test_every_member_gets_the_gang_environment(gangs: Gangs) -> None:
    pool = gangs.api()
    job = pool.job(WRITE_ENV, gang_nodes=2, cpu_milli=500)
    wait_for("the gang to end", lambda: pool.state(job) in ("released", "failed"), 60, gangs.logs)
    out = pool.get(job)
    assert out["state"] == "released" and out["reason"] == "exited 0 on all 2 nodes", out
    ranks = out["nodes"]
    peers = ",".join(ADDRESSES[n] for n in ranks)
    assert [(m["rank"], m["node"], m["address"], m["state"]) for m in out["members"]] == [
        (r, n, ADDRESSES[n], "exited") for r, n in enumerate(ranks)
    ]
    ps = subprocess.run(
        cpool("ps", "--all"),
        capture_output=True,
        text=True,
        env={**gangs.env(), "COLUMNS": "250"},
        timeout=60,
    )
    assert f"{ranks[0]}:exited,{ranks[1]}:exited" in ps.stdout, ps.stdout + ps.stderr
    seen: list[dict[str, Any]] = [
        json.loads(gangs.work_file(n, job, "gang-env.json").read_text()) for n in ranks
    ]
    port = seen[0]["MASTER_PORT"]
    assert 29500 <= int(port) <= 29999
    for rank, env in enumerate(seen):
        assert env == {
            "MASTER_ADDR": ADDRESSES[ranks[0]],
            "MASTER_PORT": port,
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "NNODES": "2",
            "NODE_RANK": str(rank),
            "NPROC_PER_NODE": "1",
            "LOCAL_WORLD_SIZE": "1",
            "CPOOL_RANK": str(rank),
            "CPOOL_PEERS": peers,
        }


def test_cpool_run_nodes_runs_a_cpu_gang(gangs: Gangs) -> None:
    done = subprocess.run(
        cpool("run", "--nodes", "2", "--gpus-per-node", "0", "--cpus", "0.5", "--",
              "sh", "-c", 'echo "$NODE_RANK $MASTER_ADDR $WORLD_SIZE"'),
        capture_output=True, text=True, env=gangs.env(), timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr + gangs.logs()
    lines = sorted(done.stdout.strip().splitlines())  # every member's, each line prefixed
    assert [line.split()[:3] for line in lines] == [["[rank", "0]", "0"], ["[rank", "1]", "1"]], done.stdout
    masters = {line.split()[3] for line in lines}
    assert len(masters) == 1 and masters <= set(ADDRESSES.values()), done.stdout
    assert [line.split()[4] for line in lines] == ["2", "2"], done.stdout
    job = re.search(r"job (\d+)", done.stderr)
    assert job is not None, done.stderr
    logs = subprocess.run(cpool("logs", job[1]), capture_output=True, text=True, env=gangs.env(), timeout=60)
    assert sorted(logs.stdout.splitlines()) == lines, logs.stdout + logs.stderr
    one = subprocess.run(
        cpool("logs", job[1], "--rank", "1"), capture_output=True, text=True, env=gangs.env(), timeout=60
    )
    assert one.stdout == lines[1].removeprefix("[rank 1] ") + "\n", one.stdout + one.stderr


def test_a_member_that_exits_3_fails_the_gang_and_the_other_is_stopped(gangs: Gangs) -> None:
    pool = gangs.api()
    job = pool.job(ONE_FAILS, gang_nodes=2, cpu_milli=500)

    # not "both running": rank 1 exits as soon as rank 0 listens, which a poll may never see
    def placed() -> list[str] | None:
        nodes = pool.get(job)["nodes"]
        return nodes if len(nodes) == 2 else None

    nodes = wait_for("the gang placed", placed, 60, gangs.logs)
    rank0 = nodes[0]
    pid = wait_for("rank 0's pid", lambda: job_pid(gangs.root / rank0, job), 60, gangs.logs)
    run1 = gangs.root / nodes[1] / "runs" / str(job) / "1"

    def rank1_cwd() -> Path | None:  # where its job.pid is: `work/` when sandboxed
        return next((d for d in (run1 / "work", run1) if (d / "job.pid").exists()), None)

    (wait_for("rank 1 started", rank1_cwd, 60, gangs.logs) / "go").write_text("")
    wait_for("the gang to fail", lambda: pool.state(job) == "failed", 60, gangs.logs)
    out = pool.get(job)
    rank1 = out["nodes"][1]
    assert out["reason"] == f"rank 1 on node {rank1} exited 3" and out["exit_code"] == 3
    assert [m["state"] for m in out["members"]] == ["stopped", "exited"]
    wait_for("rank 0 to be stopped", lambda: not alive(pid), 15, gangs.logs)
