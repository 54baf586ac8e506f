"""Two tenants on one node, for real: a root agent and a server on loopback, member tokens, and a
job of tenant A that tries everything it should not reach of tenant B's job, the agent and the pool.

The data dirs live outside /tmp, so that what stops the attacker is the sandbox's users, modes and
namespaces, not merely the job's private /tmp hiding the test's temporary files.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from e2e_helpers import JOB_PYTHON, child_env, cpool, free_port, stop, wait_for

from computepool.agent.tenants import remove_tenant_user

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent"),
]

ATTACK = r"""
import json, os, signal, sys
t = json.loads(sys.argv[1])
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "succeeded"
    except OSError as e:
        out[name] = type(e).__name__
for name, path in t["files"].items():
    attempt("read " + name, lambda p=path: open(p, "rb").read(1))
listed = {}
for name, path in t["dirs"].items():
    try:
        listed[name] = sorted(os.listdir(path))
    except OSError as e:
        out["list " + name] = type(e).__name__
for pid in t["b_pids"]:
    attempt(f"environ of B's {pid}", lambda p=pid: open(f"/proc/{p}/environ", "rb").read(1))
    attempt(f"cmdline of B's {pid}", lambda p=pid: open(f"/proc/{p}/cmdline", "rb").read(1) or 1 / 0)
    attempt(f"signal B's {pid}", lambda p=pid: os.kill(p, signal.SIGTERM))
for name, pid in t["pool_pids"].items():
    attempt("signal " + name, lambda p=pid: os.kill(p, signal.SIGTERM))
others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
out["other processes seen"] = sorted(
    open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace")[:60] for p in others
)
out["listed"] = listed
print(json.dumps(out), flush=True)
"""


class Node:
    """`cpool server` and a root `cpool agent`, each with its own data dir under /var/tmp."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.srv_dir, self.agent_dir = root / "srv", root / "agent"
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        root, env = self.root, child_env()
        with (root / "server.log").open("ab") as out:
            self.server = subprocess.Popen(
                cpool("server", "--data-dir", str(self.srv_dir), "--port", str(self.port)),
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        self.procs.append(self.server)
        wait_for("the server", lambda: httpx.get(f"{self.url}/readyz").is_success, 60, self.logs)
        token = (self.srv_dir / "admin-token").read_text().strip()
        self.admin = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        join = self.admin.post("/api/v1/join-tokens", json={}).json()["token"]
        with (root / "agent.log").open("ab") as out:
            self.agent = subprocess.Popen(
                cpool("agent", "--server", self.url, "--join-token", join, "--data-dir", str(self.agent_dir),
                      "--name", "shared", "--kill-grace-s", "1"),
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        self.procs.append(self.agent)
        wait_for("the node", lambda: self.states() == ["ready"], 60, self.logs)

    def states(self) -> list[str]:
        return [n["state"] for n in self.admin.get("/api/v1/nodes").json()["items"]]

    def logs(self) -> str:
        return "\n".join(
            (self.root / f).read_text() for f in ("server.log", "agent.log") if (self.root / f).exists()
        )

    def member(self, tenant: str) -> httpx.Client:
        assert self.admin.post("/api/v1/tenants", json={"name": tenant}).status_code == 201
        user = f"m-{tenant}"
        r = self.admin.post("/api/v1/users", json={"name": user, "tenant": tenant, "role": "member"})
        assert r.status_code == 201, r.text
        r = self.admin.post("/api/v1/tokens", json={"user": user})
        assert r.status_code == 201, r.text
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {r.json()['token']}"}, timeout=10
        )

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)


@pytest.fixture
def node() -> Iterator[Node]:
    root = Path("/var/tmp") / f"cpool-xt-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o755)
    n = Node(root)
    try:
        n.start()
        yield n
    finally:
        n.close()
        shutil.rmtree(root, ignore_errors=True)


def _submit(client: httpx.Client, command: list[str], **kw: Any) -> int:
    r = client.post("/api/v1/allocations", json={"command": command, "cpu_milli": 100, **kw})
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def test_a_tenant_reaches_nothing_of_another_tenant_or_of_the_pool(node: Node) -> None:
    ta, tb = f"xa{uuid.uuid4().hex[:6]}", f"xb{uuid.uuid4().hex[:6]}"
    try:
        a, b = node.member(ta), node.member(tb)
        victim_code = (
            "import os, time\nopen('notes.txt', 'w').write('b private')\n"
            "print('b log line', flush=True)\ntime.sleep(120)\n"
        )
        vid = _submit(b, [JOB_PYTHON, "-c", victim_code], env={"B_SECRET": "hush"})
        run_b = node.agent_dir / "runs" / str(vid) / "1"
        wait_for("B's job", lambda: (run_b / "work" / "notes.txt").exists(), 60, node.logs)
        b_pids = sorted(
            p.pid for p in psutil.process_iter() if _safe(lambda p=p: p.cwd()) == str(run_b / "work")
        )
        assert b_pids, "B's processes not found"
        targets = {
            "files": {
                "B's notes": str(run_b / "work" / "notes.txt"),
                "B's stdout log": str(run_b / "stdout.log"),
                "B's assignment": str(run_b / "assignment.json"),
                "node credential": str(node.agent_dir / "node.json"),
                "agent state db": str(node.agent_dir / "agent-state.db"),
                "pool.db": str(node.srv_dir / "pool.db"),
                "admin token": str(node.srv_dir / "admin-token"),
            },
            "dirs": {
                "B's work dir": str(run_b / "work"),
                "B's run dir": str(run_b),
                "agent data dir": str(node.agent_dir),
                "runs": str(node.agent_dir / "runs"),
                "server data dir": str(node.srv_dir),
            },
            "b_pids": b_pids,
            "pool_pids": {"the agent": node.agent.pid, "the server": node.server.pid},
        }
        aid = _submit(a, [JOB_PYTHON, "-c", ATTACK, json.dumps(targets)])
        wait_for("A's job", lambda: a.get(f"/api/v1/allocations/{aid}").json()["state"] in
                 ("released", "failed"), 60, node.logs)  # fmt: skip
        logs = a.get(f"/api/v1/allocations/{aid}/logs").json()["stdout"]["data"]
        outcome = json.loads(logs.strip().splitlines()[-1])
        seen = outcome.pop("other processes seen")
        listed = outcome.pop("listed")
        # where a directory can be listed at all, it is the job's own view: the way to its own dir
        assert {k: v for k, v in listed.items() if v} == {
            k: v for k, v in {"agent data dir": ["runs"], "runs": [str(aid)]}.items() if k in listed
        }, listed
        succeeded = {k: v for k, v in outcome.items() if v == "succeeded"}
        assert not succeeded, f"tenant A reached: {succeeded}"
        assert len(outcome) + len(listed) == 7 + 5 + 3 * len(b_pids) + 2
        assert not [c for c in seen if "b private" in c or "time.sleep(120)" in c], seen
        # B's job ran on, untouched, as its own user; each job's dir is its user's alone
        assert b.get(f"/api/v1/allocations/{vid}").json()["state"] == "active"
        work_a, work_b = (node.agent_dir / "runs" / str(aid) / "1" / "work").stat(), (run_b / "work").stat()
        assert work_a.st_uid != work_b.st_uid and work_a.st_uid != 0
        assert b.post(f"/api/v1/allocations/{vid}/cancel").status_code == 200
        wait_for("B's job stopped", lambda: not any(psutil.pid_exists(p) for p in b_pids), 30, node.logs)
        # everything the pool wrote is its owner's alone (directories others may at most pass)
        private = [node.srv_dir / n for n in ("pool.db", "pool.db-wal", "pool.db-shm", "admin-token")]
        private += [node.agent_dir / n for n in ("node.json", "agent-state.db", "agent-state.db-wal")]
        private += [run_b / n for n in ("stdout.log", "stderr.log", "assignment.json")]
        modes = {str(f): oct(stat.S_IMODE(f.stat().st_mode)) for f in private if f.exists()}
        assert set(modes.values()) == {"0o600"} and len(modes) >= len(private) - 1, modes
        for d, allowed in ((node.srv_dir, ("0o700", "0o711")), (node.agent_dir, ("0o711",))):
            assert oct(stat.S_IMODE(d.stat().st_mode)) in allowed, d
    finally:
        for t in (ta, tb):
            remove_tenant_user(t)


def _safe(fn: Any) -> Any:
    try:
        return fn()
    except (psutil.Error, OSError):
        return None
