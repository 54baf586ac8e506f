"""Ports nobody can squat, for real: `cpool server` with two service ports and two gang ports, two
root agents on loopback (127.0.0.2 and 127.0.0.3), and tenant B's jobs holding the ports tenant A
is given.

- B listens IPv6-only on `[::]:P` for each service port P before A's service starts: A's engines
  listen on `0.0.0.0:P`, which takes every connection to the node's address, so A's replicas come
  ready on those very ports and are never replaced (B's listener is sent nothing);
- B holds both gang ports (IPv4 and IPv6) on the host: rank 0 of A's gang offers another master
  port, the other member is told it, and the gang runs to its end;
- B asks to publish a privileged port, or one of the pool's own, from a container: 422 naming
  `ports`;
- on a pool whose service range lies outside the kernel's ephemeral range (so the node polices it:
  agent/port_guard.py), B's job holding the whole range on both families is stopped with the port
  named, and A's replicas then come ready on those very ports and stay.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
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
from computepool.agent.listeners import listening
from computepool.agent.tenants import remove_tenant_user

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent"),
]
SIMENGINE = job_readable_copy(Path(computepool.__file__).parent / "serving" / "simengine.py")
ADDRESSES = ("127.0.0.2", "127.0.0.3")

# B's job: listens on every port given, IPv6-only (`-6`) or on both families (`-46`), and says
# whatever reaches it
HOLD = r"""
import socket, sys, threading
families = {"-6": [socket.AF_INET6], "-46": [socket.AF_INET, socket.AF_INET6]}[sys.argv[1]]
def serve(s):
    while True:
        conn, peer = s.accept()
        print("REQUEST from", peer[0], flush=True)
        conn.close()
for port in sys.argv[2:]:
    for family in families:
        s = socket.socket(family, socket.SOCK_STREAM)
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", int(port)))
        except OSError:  # the other member, on this same machine, holds it
            continue
        s.listen()
        threading.Thread(target=serve, args=(s,), daemon=True).start()
print("holding", *sys.argv[2:], flush=True)
threading.Event().wait()
"""

# A's gang: rank 0 listens on MASTER_ADDR:MASTER_PORT, rank 1 meets it there; both exit 0
MEET = r"""
import os, socket, time
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
print("master port", port, flush=True)
if os.environ["NODE_RANK"] == "0":
    srv = socket.create_server((addr, port))
    srv.settimeout(120)
    conn, peer = srv.accept()
    conn.sendall(b"rank 0")
    conn.close()
else:
    for _ in range(1200):
        try:
            with socket.create_connection((addr, port), timeout=1) as c:
                assert c.recv(16) == b"rank 0"
            break
        except OSError:
            time.sleep(0.1)
    else:
        raise SystemExit("rank 0 never listened")
"""


def have_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


def free_pair(low: bool = False) -> int:
    """A port P with P and P + 1 free on every address of both families; `low`: below the
    kernel's ephemeral range and the pool's default ranges (10000-19998), where the node polices
    the pool's ranges."""
    for _ in range(200):
        if low:
            port = random.randrange(10000, 19999)
        else:
            with socket.socket(socket.AF_INET6) as s:
                s.bind(("::", 0))
                port = int(s.getsockname()[1])
        try:
            with socket.socket(socket.AF_INET6) as a, socket.socket(socket.AF_INET6) as b:
                a.bind(("::", port))
                b.bind(("::", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two free ports in a row")


class Pool:
    """`cpool server` whose service ports are P, P+1 and gang ports G, G+1; two root agents."""

    def __init__(self, root: Path, low: bool = False) -> None:
        self.root, self.env = root, child_env()
        self.port, self.svc, self.gang = free_pair(), free_pair(low), free_pair()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.nodes = [f"pt{uuid.uuid4().hex[:6]}-{i}" for i in range(2)]
        self.tenants: list[str] = []

    def spawn(self, name: str, *args: str) -> None:
        with (self.root / f"{name}.log").open("ab") as out:
            self.procs.append(
                subprocess.Popen(cpool(*args), stdout=out, stderr=subprocess.STDOUT, env=self.env)
            )

    def start(self) -> None:
        srv = self.root / "srv"
        self.spawn(
            "server", "server", "--data-dir", str(srv), "--port", str(self.port),
            "--service-ports", f"{self.svc}-{self.svc + 1}", "--gang-ports", f"{self.gang}-{self.gang + 1}",
        )  # fmt: skip
        wait_for("the server", lambda: httpx.get(f"{self.url}/readyz").is_success, 60, self.logs)
        token = (srv / "admin-token").read_text().strip()
        self.admin = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        join = self.admin.post("/api/v1/join-tokens", json={"single_use": False}).json()["token"]
        for name, address in zip(self.nodes, ADDRESSES, strict=True):
            data = str(self.root / name)
            self.spawn(
                name, "agent", "--server", self.url, "--join-token", join, "--data-dir", data,
                "--name", name, "--address", address, "--kill-grace-s", "1",
            )  # fmt: skip

        def ready() -> bool:
            items = self.admin.get("/api/v1/nodes").json()["items"]
            return sorted(n["name"] for n in items if n["state"] == "ready") == sorted(self.nodes)

        wait_for("both nodes", ready, 60, self.logs)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("*.log")))

    def member(self, prefix: str) -> httpx.Client:
        tenant = f"{prefix}{uuid.uuid4().hex[:6]}"
        self.tenants.append(tenant)
        assert self.admin.post("/api/v1/tenants", json={"name": tenant}).status_code == 201
        r = self.admin.post("/api/v1/users", json={"name": f"m-{tenant}", "tenant": tenant, "role": "member"})
        assert r.status_code == 201, r.text
        token = self.admin.post("/api/v1/tokens", json={"user": f"m-{tenant}"}).json()["token"]
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)

    def hold(self, client: httpx.Client, families: str, ports: list[int]) -> int:
        """B's job holding `ports` (one process per family), once it listens there. A gang over both
        nodes: its members keep the node's network (a plain process job listens in a network
        namespace of its own, where it holds no port of the node's)."""
        command = [JOB_PYTHON, "-c", HOLD, families, *map(str, ports)]
        r = client.post("/api/v1/allocations", json={"command": command, "cpu_milli": 100, "gang_nodes": 2})
        assert r.status_code == 201, r.text
        want = len(ports) * len(families.strip("-"))

        def held() -> bool:
            found = listening()
            return sum(len(found.get(p, {})) for p in ports) >= want

        wait_for(f"B's job holding {ports}", held, 60, self.logs)
        return int(r.json()["id"])

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc, signal.SIGTERM)


def started(low: bool) -> Iterator[Pool]:
    if not have_ipv6():
        pytest.skip("this machine has no IPv6 loopback")
    root = Path("/var/tmp") / f"cpool-pt-{uuid.uuid4().hex[:8]}"
    root.mkdir(mode=0o755)
    p = Pool(root, low)
    try:
        p.start()
        yield p
    finally:
        p.close()
        kill_jobs_under(root)
        for tenant in p.tenants:
            remove_tenant_user(tenant)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    """Service ports from the kernel's ephemeral range: not policed, so a squatter stays."""
    yield from started(low=False)


@pytest.fixture(scope="module")
def low_pool() -> Iterator[Pool]:
    """Service ports below the ephemeral range: the node stops a job holding one not given it."""
    yield from started(low=True)


@pytest.fixture(scope="module")
def binder_pool() -> Iterator[Pool]:
    """The same, of its own: the ports a test's replicas used are given to no replica for minutes."""
    yield from started(low=True)


def test_an_ipv6_only_squatter_on_every_replica_port_changes_nothing(pool: Pool) -> None:
    a, b = pool.member("pa"), pool.member("pb")
    ports = [pool.svc, pool.svc + 1]
    squatter = pool.hold(b, "-6", ports)
    try:
        engine = f"{JOB_PYTHON} {SIMENGINE} --slots 2 --ms-per-token 1"  # on 0.0.0.0:$PORT
        spec = {"request": {"command": ["/bin/sh", "-c", engine], "cpu_milli": 200}, "min_replicas": 2,
                "max_replicas": 2, "startup_grace_s": 30, "drain_s": 5}  # fmt: skip
        r = a.put("/api/v1/services/chat", json={"spec": spec})
        assert r.status_code == 201, r.text
        seen: set[int] = set()

        def both_ready() -> list[dict[str, Any]] | None:
            svc = a.get("/api/v1/services/chat").json()
            reps = svc["replicas"]
            seen.update(rep["allocation_id"] for rep in reps)
            assert len(seen) <= 2, f"a replica was replaced: {svc['reason']}\n{pool.logs()}"
            ready = [rep for rep in reps if rep["replica_state"] == "ready"]
            return ready if len(ready) == 2 else None

        ready = wait_for("A's two replicas ready", both_ready, 120, pool.logs)
        assert {rep["allocation_id"] for rep in ready} == seen  # the first two: none replaced
        assert {int(rep["endpoint"].rsplit(":", 1)[1]) for rep in ready} == set(ports)
        for rep in ready:
            gone = a.get(f"/api/v1/allocations/{rep['allocation_id']}").json()
            assert gone["state"] == "active" and gone["attempt"] == 1, gone
        for _ in range(2):  # A's replicas serve, through the gateway
            r = a.post("/v1/completions", json={"model": "chat", "prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200, r.text
        svc = a.get("/api/v1/services/chat").json()
        assert svc["ready"] == 2 and "held by another process" not in svc["reason"], svc
        out = b.get(f"/api/v1/allocations/{squatter}/logs").json()["stdout"]["data"]
        assert "holding" in out and "REQUEST" not in out, out  # not one health check, key or prompt
        assert a.delete("/api/v1/services/chat").status_code == 200
    finally:
        b.post(f"/api/v1/allocations/{squatter}/cancel")


def test_a_held_gang_range_on_rank_0_does_not_stop_another_tenants_gang(pool: Pool) -> None:
    a, b = pool.member("ga"), pool.member("gb")
    held = [pool.gang, pool.gang + 1]
    holder = pool.hold(b, "-46", held)  # every gang port, IPv4 and IPv6, on the host of both nodes
    try:
        r = a.post(
            "/api/v1/allocations",
            json={"command": [JOB_PYTHON, "-c", MEET], "gang_nodes": 2, "cpu_milli": 200},
        )
        assert r.status_code == 201, r.text
        gang = int(r.json()["id"])

        def ended() -> dict[str, Any] | None:
            got = dict(a.get(f"/api/v1/allocations/{gang}").json())
            return got if got["state"] in ("released", "failed", "cancelled") else None

        out = wait_for("A's gang to end", ended, 120, pool.logs)
        assert out["state"] == "released" and out["reason"] == "exited 0 on all 2 nodes", out
        assert out["attempt"] == 1 and [m["state"] for m in out["members"]] == ["exited", "exited"]
        logs = a.get(f"/api/v1/allocations/{gang}/logs").json()["stdout"]["data"]
        port = int(logs.split("master port ", 1)[1].split()[0])
        assert port not in held, logs
        out_b = b.get(f"/api/v1/allocations/{holder}/logs").json()["stdout"]["data"]
        assert "REQUEST" not in out_b, out_b  # no member dialled the holder
    finally:
        b.post(f"/api/v1/allocations/{holder}/cancel")


def test_a_container_never_publishes_a_privileged_port_or_one_of_the_pools(pool: Pool, image: str) -> None:
    b = pool.member("cb")
    publish_image(pool.admin, image, [pool.tenants[-1]])  # B may run the image: only `ports` is at stake
    job = {"command": ["python3", "-c", "pass"], "image": image, "cpu_milli": 100}
    for port in (81, 22, 1023, pool.svc, pool.gang, pool.port):
        r = b.post("/api/v1/allocations", json={**job, "ports": [port]})
        assert r.status_code == 422 and r.json()["field"] == "ports", (port, r.text)
        assert f"{port} cannot be published" in r.json()["error"], r.text
    spec = {"request": {**job, "ports": [81]}, "min_replicas": 1, "max_replicas": 1}
    r = b.put("/api/v1/services/web", json={"spec": spec})
    assert r.status_code == 422 and r.json()["field"] == "spec.request.ports", r.text
    assert b.get("/api/v1/allocations").json()["items"] == []
    r = b.post("/api/v1/allocations", json={**job, "ports": [20000 + pool.port % 9000]})  # the publish range
    assert r.status_code == 201, r.text
    assert b.post(f"/api/v1/allocations/{r.json()['id']}/cancel").status_code == 200


def test_a_job_holding_the_whole_service_range_is_stopped_and_the_replicas_come(low_pool: Pool) -> None:
    pool = low_pool
    a, b = pool.member("sa"), pool.member("sb")
    ports = [pool.svc, pool.svc + 1]
    squatter = pool.hold(b, "-46", ports)  # 0.0.0.0 and [::], on both nodes' host network

    def ended() -> dict[str, Any] | None:
        got = dict(b.get(f"/api/v1/allocations/{squatter}").json())
        return got if got["state"] in ("released", "failed", "cancelled") else None

    got = wait_for("B's squatter stopped by its node", ended, 60, pool.logs)
    assert got["state"] == "failed", got
    assert "which the pool reserves for its service range" in got["reason"], got
    assert any(f"listened on port {p}," in got["reason"] for p in ports), got
    wait_for("the range free again", lambda: not any(listening().get(p) for p in ports), 30, pool.logs)

    engine = f"{JOB_PYTHON} {SIMENGINE} --slots 2 --ms-per-token 1"  # on 0.0.0.0:$PORT: given, kept
    spec = {"request": {"command": ["/bin/sh", "-c", engine], "cpu_milli": 200}, "min_replicas": 2,
            "max_replicas": 2, "startup_grace_s": 30, "drain_s": 5}  # fmt: skip
    assert a.put("/api/v1/services/chat", json={"spec": spec}).status_code == 201

    def both_ready() -> list[dict[str, Any]] | None:
        reps = a.get("/api/v1/services/chat").json()["replicas"]
        ready = [rep for rep in reps if rep["replica_state"] == "ready"]
        return ready if len(ready) == 2 else None

    ready = wait_for("A's two replicas ready", both_ready, 120, pool.logs)
    assert {int(rep["endpoint"].rsplit(":", 1)[1]) for rep in ready} == set(ports)
    r = a.post("/v1/completions", json={"model": "chat", "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200, r.text
    for rep in ready:  # listening on the port it was given stops nothing
        got = a.get(f"/api/v1/allocations/{rep['allocation_id']}").json()
        assert got["state"] == "active" and got["attempt"] == 1, got
    assert a.delete("/api/v1/services/chat").status_code == 200


# B's job: binds every port given on both families and never listens (a bound socket holds its
# port against every later bind, yet no /proc/net table lists it)
BIND_ONLY = r"""
import socket, sys, threading
held = []
for port in map(int, sys.argv[1:]):
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # both gang members on this host
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((host, port))
        held.append(s)
print("bound", len(held), flush=True)
threading.Event().wait()
"""


def test_a_job_binding_the_service_range_without_listening_is_stopped_too(binder_pool: Pool) -> None:
    pool = binder_pool
    a, b = pool.member("ba"), pool.member("bb")
    ports = [pool.svc, pool.svc + 1]
    r = b.post(
        "/api/v1/allocations",
        # a gang: its members keep the node's network (a plain job binds in a namespace of its own)
        json={"command": [JOB_PYTHON, "-c", BIND_ONLY, *map(str, ports)], "cpu_milli": 100, "gang_nodes": 2},
    )
    assert r.status_code == 201, r.text
    squatter = int(r.json()["id"])

    def ended() -> dict[str, Any] | None:
        got = dict(b.get(f"/api/v1/allocations/{squatter}").json())
        return got if got["state"] in ("released", "failed", "cancelled") else None

    got = wait_for("B's binder stopped by its node", ended, 60, pool.logs)
    assert got["state"] == "failed", got
    assert any(
        f"bound port {p}, which the pool reserves for its service range" in got["reason"] for p in ports
    )
    assert "bound 4" in b.get(f"/api/v1/allocations/{squatter}/logs").json()["stdout"]["data"]

    engine = f"{JOB_PYTHON} {SIMENGINE} --slots 2 --ms-per-token 1"
    spec = {"request": {"command": ["/bin/sh", "-c", engine], "cpu_milli": 200}, "min_replicas": 2,
            "max_replicas": 2, "startup_grace_s": 30, "drain_s": 5}  # fmt: skip
    assert a.put("/api/v1/services/bound", json={"spec": spec}).status_code == 201

    def both_ready() -> list[dict[str, Any]] | None:
        reps = a.get("/api/v1/services/bound").json()["replicas"]
        ready = [rep for rep in reps if rep["replica_state"] == "ready"]
        return ready if len(ready) == 2 else None

    ready = wait_for("A's two replicas ready", both_ready, 120, pool.logs)
    assert {int(rep["endpoint"].rsplit(":", 1)[1]) for rep in ready} == set(ports)
    assert a.delete("/api/v1/services/bound").status_code == 200
