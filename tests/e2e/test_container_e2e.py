"""Container jobs through the whole pool: a real server, a root agent, real podman, the real image.

One node serves every test of this module (its data dirs under /var/tmp, so that what keeps a
container away from them is the sandbox, not a private /tmp). Each test makes its own tenants.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import child_env, cpool, free_port, publish_image, stop, wait_for

from computepool.agent.container import Podman
from computepool.agent.tenants import remove_tenant_user

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="container jobs need a root agent (rootful podman)"),
]

IMAGE = "localhost/pybase:1"
ENDED = ("released", "failed", "cancelled", "preempted", "lost")

PROBE = r"""
import json, os, signal, socket, sys
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
for name, path in t["dirs"].items():
    attempt("list " + name, lambda p=path: os.listdir(p))
for pid in t["pids"]:
    attempt(f"environ of {pid}", lambda p=pid: open(f"/proc/{p}/environ", "rb").read(1))
    attempt(f"signal {pid}", lambda p=pid: os.kill(p, signal.SIGTERM))
attempt("connect to the server", lambda: socket.create_connection(("127.0.0.1", t["port"]), timeout=3))
open("/work/mine.txt", "w").write("own")
out["own file"] = open("/work/mine.txt").read()
out["processes seen"] = sorted(p for p in os.listdir("/proc") if p.isdigit())
print(json.dumps(out), flush=True)
"""


class Node:
    """`cpool server` and a root `cpool agent` on loopback, one simulated A100."""

    def __init__(self, root: Path, *server_args: str) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.srv_dir, self.agent_dir = root / "srv", root / "agent"
        self.env = child_env()
        with (root / "server.log").open("ab") as out:
            self.server = subprocess.Popen(
                cpool("server", "--data-dir", str(self.srv_dir), "--port", str(self.port), *server_args),
                stdout=out, stderr=subprocess.STDOUT, env=self.env,
            )  # fmt: skip
        wait_for("the server", lambda: httpx.get(f"{self.url}/readyz").is_success, 60, self.logs)
        self.admin_token = (self.srv_dir / "admin-token").read_text().strip()
        self.admin = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.admin_token}"}, timeout=10
        )
        self.join = self.admin.post("/api/v1/join-tokens", json={}).json()["token"]
        self.agent = self.start_agent()

    def start_agent(self) -> subprocess.Popen[bytes]:
        with (self.root / "agent.log").open("ab") as out:
            agent = subprocess.Popen(
                cpool("agent", "--server", self.url, "--join-token", self.join, "--data-dir",
                      str(self.agent_dir), "--name", "ctr", "--simulate", "1xA100-80GB",
                      "--kill-grace-s", "2"),
                stdout=out, stderr=subprocess.STDOUT, env=self.env,
            )  # fmt: skip
        wait_for("the node", lambda: [n["state"] for n in self.admin.get("/api/v1/nodes").json()["items"]]
                 == ["ready"], 60, self.logs)  # fmt: skip
        return agent

    def logs(self) -> str:
        return "\n".join(
            (self.root / f).read_text()[-4000:]
            for f in ("server.log", "agent.log")
            if (self.root / f).exists()
        )

    def member(self, tenant: str) -> tuple[httpx.Client, str]:
        assert self.admin.post("/api/v1/tenants", json={"name": tenant}).status_code == 201
        user = f"m-{tenant}"
        r = self.admin.post("/api/v1/users", json={"name": user, "tenant": tenant, "role": "member"})
        assert r.status_code == 201, r.text
        r = self.admin.post("/api/v1/tokens", json={"user": user})
        assert r.status_code == 201, r.text
        token = r.json()["token"]
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=10
        ), token

    def close(self) -> None:
        stop(self.agent)
        stop(self.server)


@pytest.fixture(scope="module")
def node(image: str) -> Iterator[Node]:
    root = Path("/var/tmp") / f"cpool-ct-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o755)
    n = Node(root)
    try:
        publish_image(n.admin, image)
        yield n
    finally:
        n.close()
        podman = Podman(n.agent_dir)
        for key in podman.all_keys():
            podman.remove(key)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def tenants(node: Node) -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for t in made:
        remove_tenant_user(t)


def _tenant(node: Node, made: list[str], prefix: str) -> tuple[httpx.Client, str, str]:
    name = f"{prefix}{uuid.uuid4().hex[:6]}"
    made.append(name)
    client, token = node.member(name)
    return client, token, name


def _submit(client: httpx.Client, command: list[str], **kw: Any) -> int:
    body = {"command": command, "cpu_milli": 200, "image": IMAGE, **kw}
    r = client.post("/api/v1/allocations", json=body)
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def _ended(node: Node, client: httpx.Client, alloc_id: int, timeout: float = 90) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        a = dict(client.get(f"/api/v1/allocations/{alloc_id}").json())
        return a if a["state"] in ENDED else None

    return dict(wait_for(f"allocation {alloc_id} to end", done, timeout, node.logs))


def _logs(client: httpx.Client, alloc_id: int) -> str:
    def read() -> str:
        return str(client.get(f"/api/v1/allocations/{alloc_id}/logs").json()["stdout"]["data"])

    return str(wait_for("the job's output", read, 20))


def test_cpool_run_image_on_a_gpu_slice(node: Node, tenants: list[str]) -> None:
    """`cpool run --image … --gpus 0.5` prints the slice and its limits and exits with the command's code."""
    _, token, tenant = _tenant(node, tenants, "ca")
    code = (
        "import os\n"
        "cg = '/sys/fs/cgroup/'\n"
        "quota = open(cg + 'cpu/cpu.cfs_quota_us').read().strip() if os.path.isdir(cg + 'cpu')"
        " else open(cg + 'cpu.max').read().split()[0]\n"
        "mem = [l.split()[1] for l in open(cg + 'memory/memory.stat')"
        " if l.startswith('hierarchical_memory_limit')] if os.path.isdir(cg + 'memory') else ['?']\n"
        "print('CUDA_VISIBLE_DEVICES', os.environ['CUDA_VISIBLE_DEVICES'])\n"
        "print('uid', os.getuid(), 'cpu_quota', quota, 'memory', mem[0], 'cwd', os.getcwd())\n"
        "raise SystemExit(5)\n"
    )
    env = {**node.env, "CPOOL_SERVER": node.url, "CPOOL_TOKEN": token}
    argv = [
        "run",
        "--image",
        IMAGE,
        "--gpus",
        "0.5",
        "--cpus",
        "0.5",
        "--mem",
        "256MiB",
        "--",
        "python3",
        "-c",
    ]
    done = subprocess.run(cpool(*argv, code), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 5, done.stdout + done.stderr + node.logs()
    gpu = node.admin.get("/api/v1/nodes").json()["items"][0]["devices"][0]["uuid"]
    assert f"CUDA_VISIBLE_DEVICES {gpu}" in done.stdout
    uid = pwd.getpwnam(f"cpool-{tenant}").pw_uid
    assert f"uid {uid} cpu_quota 50000 memory {256 * 1024 * 1024} cwd /work" in done.stdout, done.stdout


def test_a_container_reaches_nothing_of_another_tenant_or_of_the_pool(node: Node, tenants: list[str]) -> None:
    a, _, _ = _tenant(node, tenants, "cx")
    b, _, _ = _tenant(node, tenants, "cy")
    victim = (
        "import time\nopen('notes.txt', 'w').write('b private')\n"
        "print('b log', flush=True)\ntime.sleep(120)\n"
    )
    vid = _submit(b, ["python3", "-c", victim], env={"B_SECRET": "hush"})
    run_b = node.agent_dir / "runs" / str(vid) / "1"
    wait_for("B's container", lambda: (run_b / "work" / "notes.txt").exists(), 90, node.logs)
    name = Podman(node.agent_dir).name(f"{vid}#1")
    pid = subprocess.run(
        ["podman", "inspect", "--format", "{{.State.Pid}}", name], capture_output=True, text=True, check=True
    ).stdout.strip()
    targets = {
        "files": {
            "B's notes": str(run_b / "work" / "notes.txt"),
            "B's stdout log": str(run_b / "stdout.log"),
            "node credential": str(node.agent_dir / "node.json"),
            "agent state db": str(node.agent_dir / "agent-state.db"),
            "pool.db": str(node.srv_dir / "pool.db"),
            "admin token": str(node.srv_dir / "admin-token"),
        },
        "dirs": {
            "B's work dir": str(run_b / "work"),
            "agent data dir": str(node.agent_dir),
            "server data dir": str(node.srv_dir),
        },
        "pids": [int(pid), node.agent.pid, node.server.pid],
        "port": node.port,
    }
    aid = _submit(a, ["python3", "-c", PROBE, json.dumps(targets)])
    assert _ended(node, a, aid)["state"] == "released", node.logs()
    outcome = json.loads(_logs(a, aid).strip().splitlines()[-1])
    assert outcome.pop("own file") == "own"  # the probe itself works: it reads what is its own
    seen = outcome.pop("processes seen")
    succeeded = {k: v for k, v in outcome.items() if v == "succeeded"}
    assert not succeeded, f"tenant A's container reached: {succeeded}"
    assert len(outcome) == 6 + 3 + 2 * 3 + 1
    assert len(seen) <= 3, seen  # its init, itself, nothing of the host
    assert b.get(f"/api/v1/allocations/{vid}").json()["state"] == "active"
    assert b.post(f"/api/v1/allocations/{vid}/cancel").status_code == 200
    _ended(node, b, vid)
    wait_for("B's container to be removed", lambda: name not in _container_names(), 30, node.logs)


def test_memory_limit_ends_the_job_as_out_of_memory(node: Node, tenants: list[str]) -> None:
    a, _, _ = _tenant(node, tenants, "cm")
    aid = _submit(a, ["python3", "-c", "x = bytearray(400 * 1024 * 1024)"], memory_mib=96)
    alloc = _ended(node, a, aid)
    assert alloc["state"] == "failed"
    assert "out of memory" in str(alloc.get("reason")), alloc


def test_missing_image_fails_fast_with_its_reason(node: Node, tenants: list[str]) -> None:
    a, _, tenant = _tenant(node, tenants, "ci")
    published = {"name": "localhost/no-such-image:1", "digest": "sha256:" + "0" * 64, "tenants": [tenant]}
    assert node.admin.post("/api/v1/images", json=published).status_code == 200
    aid = _submit(a, ["true"], image="localhost/no-such-image:1")
    alloc = _ended(node, a, aid, timeout=120)
    assert alloc["state"] == "failed"
    reason = str(alloc.get("reason"))
    assert (
        "image localhost/no-such-image:1 not found on node" in reason and "could not be pulled" in reason
    ), alloc


def test_agent_restart_readopts_a_running_container(node: Node, tenants: list[str]) -> None:
    """The agent dies (SIGKILL) and comes back: the container ran on, once, and ends reported."""
    a, _, _ = _tenant(node, tenants, "cr")
    code = "import time\nprint('started', flush=True)\ntime.sleep(8)\nprint('finished', flush=True)\n"
    aid = _submit(a, ["python3", "-c", code])
    podman = Podman(node.agent_dir)
    key = f"{aid}#1"
    wait_for("the container", lambda: key in podman.running_keys(), 90, node.logs)
    node.agent.send_signal(signal.SIGKILL)
    node.agent.wait(10)
    assert podman.running_keys() == {key}  # the workload outlives its agent
    node.agent = node.start_agent()
    alloc = _ended(node, a, aid)
    assert alloc["state"] == "released", alloc
    assert alloc.get("attempt", 1) == 1
    assert _logs(a, aid).split() == ["started", "finished"]
    wait_for("the container to be removed", lambda: key not in podman.all_keys(), 30, node.logs)
    log = (node.root / "agent.log").read_text()
    assert "re-adopted 1 running job" in log, log[-2000:]


def _container_names() -> set[str]:
    out = subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True)
    return set(out.stdout.split())


def test_container_removed_after_the_job_ends(node: Node, tenants: list[str]) -> None:
    a, _, _ = _tenant(node, tenants, "ce")
    aid = _submit(a, ["python3", "-c", "print('done')"])
    assert _ended(node, a, aid)["state"] == "released"
    name = Podman(node.agent_dir).name(f"{aid}#1")
    wait_for("the container to be removed", lambda: name not in _container_names(), 30)
    assert not list(Path("/sys/fs/cgroup").glob(f"*/computepool-containers/{name}"))
    assert not list(Path("/sys/fs/cgroup").glob(f"*/computepool-containers/*/{name}"))  # below its tenant's
    assert not list(Path("/sys/fs/cgroup").glob(f"*/computepool/*/t-*/{name}.ctr"))  # beside its jobs


def test_bench_jobs_with_an_image_runs_containers(image: str) -> None:
    argv = cpool(
        "bench", "starts", "--start-pool", "--count", "3", "--concurrency", "1", "--image", image, "--json"
    )
    done = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert (out["executor"], out["image"], out["completed"], out["failed"]) == ("container", image, 3, 0), out
    assert 0 <= out["start_latency_p50_ms"] <= out["workload_start_p50_ms"], out
