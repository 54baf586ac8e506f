"""Agents and pools sharing one host: one's jobs never end another's, and one data dir has one user.

Allocation ids are each pool's own (both pools' first job is allocation 1), and node names are too
(both default to the host name), so what an agent makes on the host, its jobs' cgroups above all,
must be named by something that is the agent's alone. Every agent here gets the same real cgroup
base (unique to the test), as agents left at the default share /sys/fs/cgroup/computepool.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from e2e_helpers import (
    JOB_PYTHON,
    alive,
    child_env,
    cpool,
    free_port,
    job_pid,
    kill_jobs_under,
    stop,
    wait_for,
)

from computepool.agent import cgroups
from computepool.agent.tenants import remove_tenant_user
from computepool.core.tls import client_context

CGROUP_ROOT = Path("/sys/fs/cgroup")
REAL_CGROUPS = os.geteuid() == 0 and (
    (CGROUP_ROOT / "cgroup.controllers").exists()
    or (CGROUP_ROOT / "memory" / "memory.limit_in_bytes").exists()
)
pytestmark = pytest.mark.skipif(not REAL_CGROUPS, reason="needs root and writable cgroups (v2 or v1)")

# Waits for a file `go` in its work dir, then exits 7: still running when the other pool's job ends.
WAITER = """
import os, sys, time
open("job.pid.new", "w").write(str(os.getpid()))
os.replace("job.pid.new", "job.pid")  # never seen half written
while not os.path.exists("go"):
    time.sleep(0.1)
sys.exit(7)
"""

# Both ranks meet at MASTER_ADDR:MASTER_PORT; each then waits for its own `go` and exits 0.
GANG = """
import os, socket, sys, time
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
open("job.pid.new", "w").write(str(os.getpid()))
os.replace("job.pid.new", "job.pid")  # never seen half written
if os.environ["NODE_RANK"] == "0":
    srv = socket.create_server((addr, port))
    srv.settimeout(120)
    srv.accept()
else:
    for _ in range(1200):
        try:
            socket.create_connection((addr, port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    else:
        sys.exit("rank 0 never listened")
while not os.path.exists("go"):
    time.sleep(0.1)
"""


class Pool:
    """`cpool server` and root `cpool agent`s on loopback, data dirs under `root` (in /var/tmp)."""

    def __init__(self, root: Path, cgroup_base: Path, user_prefix: str = "cpool-") -> None:
        self.root, self.cgroup_base, self.user_prefix = root, cgroup_base, user_prefix
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.srv_dir = root / "srv"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tenants: list[str] = []
        self.admin: httpx.Client | None = None

    def start(self) -> None:
        with (self.root / "server.log").open("ab") as out:
            self.procs.append(subprocess.Popen(
                cpool("server", "--data-dir", str(self.srv_dir), "--port", str(self.port)),
                stdout=out, stderr=subprocess.STDOUT, env=child_env(),
            ))  # fmt: skip
        wait_for("the server", lambda: httpx.get(f"{self.url}/readyz").is_success, 60, self.logs)
        token = (self.srv_dir / "admin-token").read_text().strip()
        self.admin = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def agent(self, name: str, *extra: str) -> Path:
        """A root agent named `name` (the same in both pools: the host's name, say); its data dir."""
        assert self.admin is not None
        join = self.admin.post("/api/v1/join-tokens", json={}).json()["token"]
        data = self.root / f"agent-{name}"
        with (self.root / f"agent-{name}.log").open("ab") as out:
            self.procs.append(subprocess.Popen(
                cpool("agent", "--server", self.url, "--join-token", join, "--data-dir", str(data),
                      "--name", name, "--kill-grace-s", "1", "--cgroup-base", str(self.cgroup_base),
                      "--tenant-user-prefix", self.user_prefix, *extra),
                stdout=out, stderr=subprocess.STDOUT, env=child_env(),
            ))  # fmt: skip
        wait_for(f"node {name}", lambda: self.state_of(name) == "ready", 60, self.logs)
        return data

    def state_of(self, node: str) -> str | None:
        assert self.admin is not None
        return next(
            (n["state"] for n in self.admin.get("/api/v1/nodes").json()["items"] if n["name"] == node), None
        )

    def member(self, tenant: str | None = None) -> httpx.Client:
        """A member of a new tenant (its user is removed at the end), named `tenant` or at random."""
        assert self.admin is not None
        tenant = tenant or f"sh{uuid.uuid4().hex[:6]}"
        assert self.admin.post("/api/v1/tenants", json={"name": tenant}).status_code == 201
        self.tenants.append(tenant)
        r = self.admin.post("/api/v1/users", json={"name": f"m-{tenant}", "tenant": tenant, "role": "member"})
        assert r.status_code == 201, r.text
        token = self.admin.post("/api/v1/tokens", json={"user": f"m-{tenant}"}).json()["token"]
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("*.log")))

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)
        kill_jobs_under(self.root)
        for tenant in self.tenants:
            remove_tenant_user(tenant, prefix=self.user_prefix)
        if self.admin is not None:
            self.admin.close()


def _remove_cgroups(base: Path) -> None:
    """The test's base, wherever it lies (v2, or under each v1 controller), deepest first."""
    v2 = (CGROUP_ROOT / "cgroup.controllers").exists()
    for top in [base] if v2 else list(CGROUP_ROOT.glob(f"*/{base.name}")):
        cgroups.remove(sorted(top.glob("**/"), key=lambda p: len(p.parts), reverse=True))


@pytest.fixture
def host() -> Iterator[tuple[Path, Path]]:
    """A root for the pools' data dirs (outside /tmp, which each job has its own of) and a cgroup base."""
    tag = uuid.uuid4().hex[:8]
    root, base = Path("/var/tmp") / f"cpool-sh-{tag}", CGROUP_ROOT / f"cpool-sh-{tag}"
    root.mkdir(mode=0o755)
    try:
        yield root, base
    finally:
        _remove_cgroups(base)
        shutil.rmtree(root, ignore_errors=True)


def _get(client: httpx.Client, alloc_id: int) -> dict[str, Any]:
    return dict(client.get(f"/api/v1/allocations/{alloc_id}").json())


def test_a_job_of_another_pool_with_the_same_allocation_id_is_not_killed(host: tuple[Path, Path]) -> None:
    root, base = host
    (root / "a").mkdir()
    (root / "b").mkdir()
    pool_a, pool_b = Pool(root / "a", base), Pool(root / "b", base)
    try:
        for pool in (pool_a, pool_b):
            pool.start()
        agent_a, agent_b = pool_a.agent("shared"), pool_b.agent("shared")
        a, b = pool_a.member(), pool_b.member()
        victim = b.post("/api/v1/allocations", json={"command": [JOB_PYTHON, "-c", WAITER], "cpu_milli": 100})
        assert victim.status_code == 201 and victim.json()["id"] == 1, victim.text
        pid = wait_for("pool B's job 1", lambda: job_pid(agent_b, 1), 60, pool_b.logs)

        quick = a.post("/api/v1/allocations", json={"command": [JOB_PYTHON, "-c", "pass"], "cpu_milli": 100})
        assert quick.status_code == 201 and quick.json()["id"] == 1, quick.text
        wait_for("pool A's job 1 to end", lambda: _get(a, 1)["state"] == "released", 60, pool_a.logs)
        assert alive(pid), "pool A's job 1 ending killed pool B's job 1\n" + pool_b.logs()
        assert _get(b, 1)["state"] == "active"

        (agent_b / "runs" / "1" / "1" / "work" / "go").touch()
        wait_for("pool B's job 1 to end", lambda: _get(b, 1)["state"] == "failed", 60, pool_b.logs)
        out = _get(b, 1)
        assert out["exit_code"] == 7 and "exit code 7" in out["reason"], out
        assert agent_a != agent_b
    finally:
        pool_a.close()
        pool_b.close()


WHO = "import json, os; print(json.dumps([os.getuid(), os.environ['CPOOL_CACHE_DIR']]), flush=True)"


def test_a_tenant_of_another_pool_with_the_same_name_shares_no_uid_and_no_cache(
    host: tuple[Path, Path],
) -> None:
    root, base = host
    (root / "a").mkdir()
    (root / "b").mkdir()
    pool_a, pool_b = Pool(root / "a", base), Pool(root / "b", base, user_prefix="cpb-")
    name = f"same{uuid.uuid4().hex[:6]}"
    try:
        seen = []
        for pool in (pool_a, pool_b):
            pool.start()
            pool.agent("shared")
            client = pool.member(name)
            r = client.post(
                "/api/v1/allocations", json={"command": [JOB_PYTHON, "-c", WHO], "cpu_milli": 100}
            )
            assert r.status_code == 201, r.text
            job = int(r.json()["id"])
            wait_for("the job", lambda c=client, j=job: _get(c, j)["state"] == "released", 60, pool.logs)
            out = client.get(f"/api/v1/allocations/{job}/logs").json()["stdout"]["data"]
            seen.append(json.loads(out))
        (uid_a, cache_a), (uid_b, cache_b) = seen
        assert uid_a != uid_b and cache_a != cache_b, seen
        assert Path(cache_a).stat().st_uid == uid_a and Path(cache_b).stat().st_uid == uid_b
    finally:
        pool_a.close()
        pool_b.close()


def test_the_readme_second_agent_on_one_machine_runs_a_gang_to_its_end(host: tuple[Path, Path]) -> None:
    root, base = host
    pool = Pool(root, base)
    try:
        pool.start()
        dirs = {
            name: pool.agent(name, "--address", addr)
            for name, addr in (("vm1", "127.0.0.2"), ("vm2", "127.0.0.3"))
        }
        client = pool.member()
        r = client.post("/api/v1/allocations", json={"command": [JOB_PYTHON, "-c", GANG], "cpu_milli": 500,
                                                     "gang_nodes": 2})  # fmt: skip
        assert r.status_code == 201, r.text
        job = int(r.json()["id"])

        def members() -> list[str]:
            return [m["state"] for m in _get(client, job)["members"]]

        wait_for("both members running", lambda: members() == ["running", "running"], 90, pool.logs)
        rank0, rank1 = _get(client, job)["nodes"]
        pid = wait_for("rank 0's pid", lambda: job_pid(dirs[rank0], job), 30, pool.logs)
        (dirs[rank1] / "runs" / str(job) / "1" / "work" / "go").touch()
        wait_for("rank 1 to exit", lambda: members()[1] == "exited", 60, pool.logs)
        assert alive(pid), "rank 1 ending killed rank 0 on the other agent\n" + pool.logs()
        assert members() == ["running", "exited"]
        (dirs[rank0] / "runs" / str(job) / "1" / "work" / "go").touch()
        wait_for(
            "the gang to end", lambda: _get(client, job)["state"] in ("released", "failed"), 60, pool.logs
        )
        out = _get(client, job)
        assert (out["state"], out["reason"]) == ("released", "exited 0 on all 2 nodes"), out
    finally:
        pool.close()


def _second(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A second process on a data dir in use: it must give up at once (killed after 60 s if not)."""
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, stdin=subprocess.DEVNULL)


def _refused(done: subprocess.CompletedProcess[str], holder: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stdout + done.stderr
    assert lines[0].startswith("error: data dir ") and holder in lines[0], lines


def test_a_second_server_or_agent_on_a_data_dir_in_use_fails_naming_the_holder(
    host: tuple[Path, Path],
) -> None:
    root, base = host
    pool = Pool(root, base)
    try:
        pool.start()
        agent_dir = pool.agent("only")
        server, agent = pool.procs
        env = child_env()
        other = str(free_port())
        done = _second(cpool("server", "--data-dir", str(pool.srv_dir), "--port", other), env)
        _refused(done, f"pid {server.pid} (cpool server)")
        done = _second(
            cpool("agent", "--server", pool.url, "--data-dir", str(agent_dir), "--name", "dup"), env
        )
        _refused(done, f"pid {agent.pid} (cpool agent)")
        assert pool.state_of("dup") is None and pool.state_of("only") == "ready"
        stop(agent)
        from computepool.core.dirlock import lock_data_dir

        lock_data_dir(agent_dir, "test").release()  # free again once its agent has gone
    finally:
        pool.close()


def _job_cgroup(base: Path, node_dir: str, job: str) -> Path:
    """Where a job's cgroup lists its processes: on v2 its own dir, on v1 its memory controller's;
    below its tenant's directory (`t-<digest>`)."""
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        node = base / node_dir
    else:
        node = CGROUP_ROOT / "memory" / base.name / node_dir
    found = sorted(node.glob(f"t-*/{job}"))
    assert len(found) == 1, (node, found)
    return found[0]


def test_cpool_up_holds_its_data_dir_and_gives_its_agent_the_cgroup_base(host: tuple[Path, Path]) -> None:
    from computepool.agent.identity import node_key
    from computepool.agent.join import default_node_name
    from computepool.core.dirlock import LOCK_FILE, lock_data_dir

    root, base = host
    data, port, log = root / "pool", free_port(), root / "up.log"
    with log.open("wb") as out:
        up = subprocess.Popen(
            cpool("up", "--simulate", "1xT4-16GB", "--data-dir", str(data), "--port", str(port),
                  "--cgroup-base", str(base)),
            stdout=out, stderr=subprocess.STDOUT, env=child_env(),
        )  # fmt: skip
    try:
        wait_for("cpool up", lambda: "ComputePool is up" in log.read_text(), 60, log.read_text)
        children = {c.cmdline()[3]: c.pid for c in psutil.Process(up.pid).children()}  # server, agent
        env = child_env()
        done = _second(cpool("up", "--data-dir", str(data), "--port", str(free_port())), env)
        _refused(done, f"pid {up.pid} (cpool up), pid {children['server']} (cpool server)")
        done = _second(cpool("server", "--data-dir", str(data), "--port", str(free_port())), env)
        _refused(done, f"pid {up.pid} (cpool up)")
        url = f"https://127.0.0.1:{port}"
        done = _second(cpool("agent", "--server", url, "--data-dir", str(data / "agent")), env)
        _refused(done, f"pid {children['agent']} (cpool agent)")

        # the agent it started took --cgroup-base: its job's cgroup is <base>/<its own dir>/<job>.1
        token = (data / "admin-token").read_text().strip()
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"},
                          verify=client_context(data / "tls" / "cert.pem"), timeout=30) as admin:  # fmt: skip
            r = admin.post(
                "/api/v1/allocations", json={"command": [JOB_PYTHON, "-c", WAITER], "cpu_milli": 100}
            )
            assert r.status_code == 201, r.text
            job = int(r.json()["id"])
            pid = wait_for("the job", lambda: job_pid(data / "agent", job), 60, log.read_text)
            cgroup = _job_cgroup(base, node_key(data / "agent", default_node_name()), f"{job}.1")
            assert pid in {int(x) for x in (cgroup / "cgroup.procs").read_text().split()}, cgroup
    finally:
        stop(up, signal.SIGINT, timeout=40)
        kill_jobs_under(data)
    assert (data / LOCK_FILE).exists()
    lock_data_dir(data, "test").release()  # free again once `cpool up` and its children have gone
