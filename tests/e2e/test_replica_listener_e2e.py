"""Another process squats a replica's port, for real: a server whose service ports are two, a root
agent, and a process on the node (as a job of another tenant's that keeps the node's network, a
gang member's say, could; a plain process job listens in a network namespace of its own) listening
on the port tenant A's replica is given, answering 200 to every health check. The agent sees that
the port is not the replica's own, so the replica is never ready through the squatter (which is
never shown A's key); past its start-up grace it is replaced on the other port, where A's own
engine listens, and serves through the gateway."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import (
    JOB_PYTHON,
    child_env,
    cpool,
    job_readable_copy,
    kill_jobs_under,
    publish_image,
    stop,
    wait_for,
)

import computepool
from computepool.agent.tenants import remove_tenant_user

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent"),
]
# a copy jobs can read wherever the checkout is (their sandbox hides /tmp)
SIMENGINE = job_readable_copy(Path(computepool.__file__).parent / "serving" / "simengine.py")

# the squatter: answers 200 on every path, and says what it was sent (headers included)
SQUAT = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def answer(self):
        print("REQUEST", self.command, self.path, self.headers.get("Authorization"), flush=True)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
    do_GET = do_POST = answer
    def log_message(self, *a):
        pass
print("squatting", flush=True)
http.server.ThreadingHTTPServer(("", int(sys.argv[1])), H).serve_forever()
"""


def two_free_ports() -> int:
    """A port P with P and P + 1 both free on every address."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("", port))
                b.bind(("", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two free ports in a row")


class Node:
    """`cpool server --service-ports P-(P+1)` and a root `cpool agent` named `shared`."""

    def __init__(self, root: Path) -> None:
        self.root, self.env = root, child_env()
        self.port = two_free_ports()
        self.svc_port = two_free_ports()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, name: str, *args: str) -> None:
        with (self.root / f"{name}.log").open("ab") as out:
            self.procs.append(
                subprocess.Popen(cpool(*args), stdout=out, stderr=subprocess.STDOUT, env=self.env)
            )

    def start(self) -> None:
        srv = self.root / "srv"
        ports = f"{self.svc_port}-{self.svc_port + 1}"
        self.spawn(
            "server", "server", "--data-dir", str(srv), "--port", str(self.port), "--service-ports", ports
        )
        wait_for("the server", lambda: httpx.get(f"{self.url}/readyz").is_success, 60, self.logs)
        token = (srv / "admin-token").read_text().strip()
        self.admin = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        join = self.admin.post("/api/v1/join-tokens", json={}).json()["token"]
        agent = ("agent", "--server", self.url, "--join-token", join, "--data-dir", str(self.root / "agent"))
        self.spawn("agent", *agent, "--name", "shared", "--kill-grace-s", "1")
        wait_for(
            "the node",
            lambda: [n["state"] for n in self.admin.get("/api/v1/nodes").json()["items"]] == ["ready"],
            60,
            self.logs,
        )

    def logs(self) -> str:
        return "\n".join(
            (self.root / f).read_text() for f in ("server.log", "agent.log") if (self.root / f).exists()
        )

    def member(self, tenant: str) -> httpx.Client:
        assert self.admin.post("/api/v1/tenants", json={"name": tenant}).status_code == 201
        r = self.admin.post("/api/v1/users", json={"name": f"m-{tenant}", "tenant": tenant, "role": "member"})
        assert r.status_code == 201, r.text
        token = self.admin.post("/api/v1/tokens", json={"user": f"m-{tenant}"}).json()["token"]
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)


@pytest.fixture
def node() -> Iterator[Node]:
    root = Path("/var/tmp") / f"cpool-ln-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o755)
    n = Node(root)
    try:
        n.start()
        yield n
    finally:
        n.close()
        kill_jobs_under(root)
        shutil.rmtree(root, ignore_errors=True)


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_a_squatted_port_never_makes_a_replica_ready(node: Node) -> None:
    ta = f"la{uuid.uuid4().hex[:6]}"
    p = node.svc_port
    said = node.root / "squatter.log"
    with said.open("wb") as out:
        squatter = subprocess.Popen([JOB_PYTHON, "-c", SQUAT, str(p)], stdout=out, stderr=subprocess.STDOUT)
    try:
        a = node.member(ta)
        wait_for("the squatter listening on the first service port", lambda: listening(p), 60, node.logs)

        # A's engine retries until it can bind its port: the squatter is there first
        engine = f"until {JOB_PYTHON} {SIMENGINE} --slots 2 --ms-per-token 1; do sleep 0.5; done"
        spec = {"request": {"command": ["/bin/sh", "-c", engine], "cpu_milli": 200}, "min_replicas": 1,
                "max_replicas": 1, "startup_grace_s": 8, "drain_s": 5}  # fmt: skip
        r = a.put("/api/v1/services/chat", json={"spec": spec})
        assert r.status_code == 201, r.text

        seen: dict[int, set[str | None]] = {}
        endpoints: dict[int, str | None] = {}

        def ready_replacement() -> dict[str, Any] | None:
            for rep in a.get("/api/v1/services/chat").json()["replicas"]:
                seen.setdefault(rep["allocation_id"], set()).add(rep["replica_state"])
                endpoints[rep["allocation_id"]] = rep["endpoint"]
                if rep["replica_state"] == "ready":
                    return dict(rep)
            return None

        def show() -> str:
            return a.get("/api/v1/services/chat").text + "\n" + node.logs()[-3000:]

        deadline = time.monotonic() + 120
        ready = None
        while ready is None:
            assert time.monotonic() < deadline, show()
            ready = ready_replacement()
            time.sleep(0.2)
        first = min(seen)
        assert first != ready["allocation_id"], seen
        assert "ready" not in seen[first], seen  # never ready through B's listener
        assert endpoints[first] == f"http://127.0.0.1:{p}"
        gone = a.get(f"/api/v1/allocations/{first}").json()
        assert gone["state"] == "cancelled", gone
        assert gone["reason"] == f"port {p} on node shared is held by another process", gone
        assert ready["endpoint"] == f"http://127.0.0.1:{p + 1}"

        # A's replica serves through the gateway, on its own port
        r = a.post("/v1/completions", json={"model": "chat", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        # the squatter was sent nothing: no health check, no key, no prompt
        out = said.read_text()
        assert "squatting" in out and "REQUEST" not in out, out
        # the agent named the intruder in its own log
        assert f"port {p} is held by another process" in (node.root / "agent.log").read_text()
        assert a.delete("/api/v1/services/chat").status_code == 200
    finally:
        stop(squatter)
        remove_tenant_user(ta)


HEALTH = r"""
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("", int(os.environ["PORT"])), H).serve_forever()
"""


def test_a_container_replica_is_its_own_listener(node: Node, image: str) -> None:
    publish_image(node.admin, image)
    """A container's engine listens in the container's network; on the node the published port is
    held by podman's conmon for that container, which the agent counts as the replica's own."""
    tenant = f"lc{uuid.uuid4().hex[:6]}"
    try:
        a = node.member(tenant)
        request = {"command": ["python3", "-c", HEALTH], "cpu_milli": 200, "image": image}
        spec = {
            "request": request,
            "min_replicas": 1,
            "max_replicas": 1,
            "startup_grace_s": 120,
            "drain_s": 5,
        }
        r = a.put("/api/v1/services/web", json={"spec": spec})
        assert r.status_code == 201, r.text

        def ready() -> dict[str, Any] | None:
            reps = a.get("/api/v1/services/web").json()["replicas"]
            return dict(reps[0]) if reps and reps[0]["replica_state"] == "ready" else None

        rep = wait_for("the container replica ready", ready, 120, lambda: node.logs()[-3000:])
        assert httpx.get(rep["endpoint"] + "/health", timeout=5).status_code == 200
        assert a.delete("/api/v1/services/web").status_code == 200
    finally:
        remove_tenant_user(tenant)
