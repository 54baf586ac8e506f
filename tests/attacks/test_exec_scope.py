"""`cpool exec` into a job that keeps the node's network (a gang member): the exec'd command is held
by the same Landlock scope as the job, so it reaches no abstract unix socket of the node's network
namespace (another tenant's gang member, NCCL, a host daemon)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator

import httpx
import pytest
from e2e_helpers import JOB_PYTHON, cpool, publish_image, wait_for
from job_node import Node, job_node

from computepool.agent import landlock

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and namespaces need a root agent"),
    pytest.mark.skipif(shutil.which("slirp4netns") is None, reason="a job's own network needs slirp4netns"),
    pytest.mark.skipif(landlock.probe() != "", reason="the kernel has no Landlock scopes"),
]

# Connects to the abstract socket named in argv[1]; prints what came of it.
DIAL = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect("\0" + sys.argv[1])
    print("connected")
except OSError as e:
    print("refused", e.errno)
"""


@pytest.fixture(scope="module")
def gang() -> Iterator[tuple[Node, str, int]]:
    with job_node() as node:
        node.add_agent()
        tenant, b = node.member("eb")
        r = b.post(
            "/api/v1/allocations",
            json={"command": ["sleep", "300"], "cpu_milli": 100, "gang_nodes": 2},
        )
        assert r.status_code == 201, r.text
        alloc = int(r.json()["id"])
        active = lambda: b.get(f"/api/v1/allocations/{alloc}").json()["state"] == "active"  # noqa: E731
        wait_for("B's gang", active, 60, node.logs)
        yield node, tenant, alloc


def test_an_exec_into_a_gang_member_reaches_no_abstract_socket_of_the_node(
    gang: tuple[Node, str, int],
) -> None:
    node, tenant, alloc = gang
    name = f"cpool-victim-{uuid.uuid4().hex[:8]}"
    victim = socket.socket(socket.AF_UNIX)  # a listener of the node's network namespace (as A's would be)
    victim.bind("\0" + name)
    victim.listen()
    try:
        r = subprocess.run(
            cpool("exec", str(alloc), "--", JOB_PYTHON, "-c", DIAL, name),
            capture_output=True, env=node.cli_env(tenant), timeout=60,
        )  # fmt: skip
        out = r.stdout.decode()
        assert r.returncode == 0, (r.stderr.decode(), node.logs())
        assert out.strip() == "refused 1", out  # EPERM
    finally:
        victim.close()


def test_an_exec_into_a_container_worker_reaches_no_abstract_socket_of_the_node(
    gang: tuple[Node, str, int], image: str
) -> None:
    """A function's worker container runs on the host's network; `podman exec` into it, run by the
    agent, put the command outside the container's Landlock domain (it connected): now refused."""
    node, tenant, gang_id = gang
    client = httpx.Client(
        base_url=node.url, headers={"Authorization": f"Bearer {node.tokens[tenant]}"}, timeout=30
    )
    publish_image(node.admin, image, [tenant])
    request = {"command": ["sleep", "300"], "image": image, "cpu_milli": 100}
    r = client.post("/api/v1/functions", json={"name": f"w{uuid.uuid4().hex[:6]}", "request": request})
    assert r.status_code == 201, r.text
    fid = r.json()["id"]
    r = client.post(f"/api/v1/functions/{fid}/calls", json={"calls": [{"args": "eA=="}]})
    assert r.status_code == 200, r.text

    def worker() -> int | None:
        items = client.get("/api/v1/allocations").json()["items"]
        return next((int(i["id"]) for i in items if i["id"] != gang_id and i["state"] == "active"), None)

    alloc = wait_for("the worker container", worker, 90, node.logs)
    name = f"cpool-victim-{uuid.uuid4().hex[:8]}"
    victim = socket.socket(socket.AF_UNIX)
    victim.bind("\0" + name)
    victim.listen()
    try:
        r2 = subprocess.run(
            cpool("exec", str(alloc), "--", "python3", "-c", DIAL, name),
            capture_output=True, env=node.cli_env(tenant), timeout=60,
        )  # fmt: skip
        err = r2.stderr.decode()
        assert r2.returncode != 0 and "exec is refused" in err and "Traceback" not in err, (err, node.logs())
        assert len(err.strip().splitlines()) == 1 and r2.stdout == b"", (err, r2.stdout)
    finally:
        victim.close()
