"""Any tenant's code on the node's network, through a function's worker.

A function's worker is an allocation of the tenant's own request (any command), and it kept the
node's network so that it could call the control plane back. So every tenant could run code on
the node's network and loopback: the pool's and the node's loopback services, other tenants' jobs
listening there, the cloud's metadata service. A worker whose control plane is not on the node's
loopback now gets a network of its own like any process job, and calls the control plane through
slirp4netns; only a control plane on the node's loopback (`cpool up`) still needs the node's.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Iterator

import pytest
from e2e_helpers import JOB_PYTHON, wait_for
from job_node import Node, job_node, secret_listener

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and namespaces need a root agent"),
    pytest.mark.skipif(shutil.which("slirp4netns") is None, reason="a job's own network needs slirp4netns"),
]

# The worker's command: the control plane's health, then a listener on the node's loopback.
DIAL = r"""
import json, os, socket, sys, urllib.request
out = {"healthz": urllib.request.urlopen(os.environ["CPOOL_SERVER"] + "/healthz", timeout=10).status}
s = socket.socket()
s.settimeout(5)
try:
    s.connect(("127.0.0.1", int(sys.argv[1])))
    out["node loopback"] = s.recv(64).decode()
except OSError as e:
    out["node loopback"] = f"refused: {e.strerror}"
print(json.dumps(out), flush=True)
"""


def _address() -> str | None:
    """This host's address on its outbound route (no packet is sent), if it is not a loopback one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if address.startswith("127.") else address


@pytest.fixture
def node() -> Iterator[Node]:
    address = _address()
    if address is None:
        pytest.skip("no address but loopback on this host")
    with job_node(host=address) as n:
        yield n


def test_a_worker_of_a_control_plane_elsewhere_has_a_network_of_its_own(node: Node) -> None:
    pool_side = socket.create_server(("127.0.0.1", 0))  # a service on the node's loopback
    accepted = secret_listener(pool_side, b"POOL-SECRET")
    try:
        _, b = node.member("wn")
        request = {"command": [JOB_PYTHON, "-c", DIAL, str(pool_side.getsockname()[1])], "cpu_milli": 100}
        r = b.post("/api/v1/functions", json={"name": "dial", "request": request})
        assert r.status_code == 201, r.text
        assert (
            b.post(
                f"/api/v1/functions/{r.json()['id']}/calls", json={"calls": [{"args": "eA=="}]}
            ).status_code
            == 200
        )

        def said() -> dict[str, object] | None:
            for item in b.get("/api/v1/allocations").json()["items"]:
                out = str(b.get(f"/api/v1/allocations/{item['id']}/logs").json()["stdout"]["data"])
                if out.startswith("{"):
                    return dict(json.loads(out.splitlines()[-1]))
            return None

        got = wait_for("the worker's dial", said, 90, node.logs)
        assert got == {"healthz": 200, "node loopback": "refused: Connection refused"}, got
        assert accepted == []
    finally:
        pool_side.close()
