"""A tenant's container on the node's network reaches the node's abstract unix sockets.

A function's worker keeps the node's network (it calls the control plane back, which may listen
on the node's loopback), and its request is the tenant's own: any command, any image it may run.
As a container it ran with `--network=host` and, unlike a process job there, in no Landlock
domain, so it connected to every abstract unix socket of the node's network namespace: those of
another tenant's jobs on that network (gang members, replicas, workers: NCCL's, a debugger's) and
the node's own daemons'. Now podman, and all it starts, runs in a domain scoped for abstract
sockets and signals. The listener here is the test's own, in the node's network namespace.
"""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from collections.abc import Iterator

import pytest
from e2e_helpers import publish_image, wait_for
from job_node import Node, job_node, secret_listener

from computepool.agent.landlock import probe as landlock_probe

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and podman need a root agent"),
    pytest.mark.skipif(shutil.which("podman") is None, reason="containers need podman"),
    pytest.mark.skipif(bool(landlock_probe()), reason="the kernel has no Landlock scopes"),
]

DIAL = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect("\0" + sys.argv[1])
    print("read:", s.recv(64).decode(), flush=True)
except OSError as e:
    print("refused:", e.strerror, flush=True)
"""


@pytest.fixture
def node() -> Iterator[Node]:
    with job_node() as n:
        yield n


def test_a_container_worker_cannot_connect_to_the_nodes_abstract_sockets(node: Node, image: str) -> None:
    name = f"cpool-node-{uuid.uuid4().hex[:8]}"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind("\0" + name)
    listener.listen()
    accepted = secret_listener(listener, b"NODE-SECRET")
    try:
        tenant, b = node.member("wc")
        publish_image(node.admin, image, [tenant])
        request = {"command": ["python3", "-c", DIAL, name], "image": image, "cpu_milli": 100}
        r = b.post("/api/v1/functions", json={"name": "dial", "request": request})
        assert r.status_code == 201, r.text
        fid = r.json()["id"]
        assert b.post(f"/api/v1/functions/{fid}/calls", json={"calls": [{"args": "eA=="}]}).status_code == 200

        def said() -> str | None:
            for item in b.get("/api/v1/allocations").json()["items"]:
                out = str(b.get(f"/api/v1/allocations/{item['id']}/logs").json()["stdout"]["data"])
                if "read:" in out or "refused:" in out:
                    return out.strip()
            return None

        out = wait_for("the worker's dial", said, 90, node.logs)
        assert out == "refused: Operation not permitted", out
        assert accepted == []
    finally:
        listener.close()
