"""Tenants' process jobs reach no other job's, and none of the node's, local sockets.

Process jobs shared the node's network namespace: tenant B's job connected to tenant A's job's
abstract unix socket and to its TCP listener on 127.0.0.1 (an unauthenticated Jupyter, TensorBoard
or debug port), and to the pool's own services on the node's loopback. Now each job that keeps no
port of the pool's has a network namespace of its own (agent/jobnet.py: a private loopback, its
traffic out through slirp4netns, which never connects to the node's loopback), and every job a
Landlock domain scoped for abstract unix sockets and signals (agent/landlock.py). Its traffic to
other hosts still flows: here, to a listener in a namespace this test makes, over a veth pair.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2e_helpers import JOB_PYTHON, free_port, wait_for
from job_node import Node, job_node
from netns import entered

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and namespaces need a root agent"),
    pytest.mark.skipif(shutil.which("slirp4netns") is None, reason="a job's own network needs slirp4netns"),
]

# A's job: an abstract unix socket and a TCP listener on 127.0.0.1 that hand out a secret.
LISTEN = r"""
import select, socket, sys, time
u = socket.socket(socket.AF_UNIX)
u.bind("\0" + sys.argv[1])
u.listen()
t = socket.socket()
t.bind(("127.0.0.1", int(sys.argv[2])))
t.listen()
print("ready", flush=True)
end = time.time() + 120
while time.time() < end:
    for s in select.select([u, t], [], [], 1)[0]:
        c = s.accept()[0]
        c.sendall(b"A-SECRET")
        c.close()
"""

# B's job: what it reads from each address (argv: a JSON {what: [family, address]}), or its error.
DIAL = r"""
import json, socket, sys
out = {}
for what, (family, address) in json.loads(sys.argv[1]).items():
    s = socket.socket(socket.AF_UNIX if family == "unix" else socket.AF_INET)
    s.settimeout(5)
    try:
        s.connect(address if family == "unix" else tuple(address))
        out[what] = s.recv(64).decode()
    except OSError as e:
        out[what] = f"refused: {e}"
    finally:
        s.close()
print(json.dumps(out), flush=True)
"""


class Listener:
    """A TCP listener that hands `secret` to every connection, accepting on a thread of its own."""

    def __init__(self, sock: socket.socket, secret: bytes) -> None:
        self.sock, self.secret = sock, secret
        self.address = sock.getsockname()
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c = self.sock.accept()[0]
            except OSError:
                return
            self.accepted += 1
            c.sendall(self.secret)
            c.close()


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with job_node() as n:
        yield n


def _stdout(node: Node, aid: int) -> str:
    log = node.agent_dir / "runs" / str(aid) / "1" / "stdout.log"
    return log.read_text() if log.exists() else ""


def _run(node: Node, client: httpx.Client, command: list[str]) -> dict[str, Any]:
    aid = node.submit(client, command)
    job = node.ended(client, aid)
    out = _stdout(node, aid)
    assert job["state"] == "released", f"{job}\n{out}\n{node.logs()}"
    return dict(json.loads(out.strip().splitlines()[-1]))


@pytest.fixture(scope="module")
def dialed(node: Node) -> dict[str, Any]:
    """Tenant A's job listens; tenant B's job dials it, the node's loopback and slirp's gateway."""
    _, a = node.member("na")
    _, b = node.member("nb")
    name, port = f"cpool-net-{uuid.uuid4().hex[:8]}", free_port()
    pool_side = socket.create_server(("127.0.0.1", 0))  # the pool's own service on the node's loopback
    host = Listener(pool_side, b"POOL-SECRET")
    victim = node.submit(a, [JOB_PYTHON, "-c", LISTEN, name, str(port)])
    try:
        wait_for("A's listeners", lambda: "ready" in _stdout(node, victim), 60, node.logs)
        targets = {
            "abstract": ["unix", "\0" + name],
            "loopback": ["inet", ["127.0.0.1", port]],
            "node loopback": ["inet", ["127.0.0.1", host.address[1]]],
            "node loopback via the gateway": ["inet", ["10.0.2.2", host.address[1]]],
        }
        got = _run(node, b, [JOB_PYTHON, "-c", DIAL, json.dumps(targets)])
        return got | {"node loopback accepted": host.accepted}
    finally:
        a.post(f"/api/v1/allocations/{victim}/cancel")
        pool_side.close()


def test_a_job_cannot_connect_to_another_tenants_abstract_unix_socket(dialed: dict[str, Any]) -> None:
    assert dialed["abstract"].startswith("refused"), dialed


def test_a_job_cannot_connect_to_another_tenants_loopback_listener(dialed: dict[str, Any]) -> None:
    assert dialed["loopback"].startswith("refused"), dialed


def test_a_job_cannot_reach_the_nodes_loopback_services(dialed: dict[str, Any]) -> None:
    assert dialed["node loopback"].startswith("refused"), dialed
    assert dialed["node loopback via the gateway"].startswith("refused"), dialed
    assert dialed["node loopback accepted"] == 0, dialed


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@pytest.fixture
def elsewhere() -> Iterator[tuple[str, str]]:
    """A network namespace of this test's own behind a veth pair (a /30 of 10.233/16): (its name,
    its address)."""
    yield from _behind_veth("10.233")


@pytest.fixture
def metadata_service() -> Iterator[tuple[str, str]]:
    """The same on a /30 of the link-local 169.254/16, where clouds answer with the node's credentials."""
    yield from _behind_veth("169.254")


def _behind_veth(net16: str) -> Iterator[tuple[str, str]]:
    if shutil.which("ip") is None:
        pytest.skip("no `ip` (iproute2) to make a namespace")
    tag = uuid.uuid4().hex[:6]
    ns, near, far = f"cpool-out-{tag}", f"cvh{tag}", f"cvn{tag}"
    base = f"{net16}.{random.randrange(1, 255)}.{random.randrange(64) * 4}"
    prefix, last = base.rsplit(".", 1)
    mine, theirs = f"{prefix}.{int(last) + 1}", f"{prefix}.{int(last) + 2}"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", near, "type", "veth", "peer", "name", far, "netns", ns)
        _ip("addr", "add", f"{mine}/30", "dev", near)
        _ip("link", "set", near, "up")
        _ip("-n", ns, "addr", "add", f"{theirs}/30", "dev", far)
        _ip("-n", ns, "link", "set", far, "up")
        yield ns, theirs
    finally:
        subprocess.run(["ip", "link", "del", near], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def test_a_job_still_reaches_other_hosts(node: Node, elsewhere: tuple[str, str]) -> None:
    ns, address = elsewhere
    with entered(ns):
        sock = socket.create_server((address, 0))
    far = Listener(sock, b"FAR-HELLO")
    try:
        _, c = node.member("no")
        got = _run(node, c, [JOB_PYTHON, "-c", DIAL, json.dumps({"far": ["inet", list(far.address)]})])
        assert got == {"far": "FAR-HELLO"} and far.accepted == 1, got
    finally:
        sock.close()


def test_a_job_cannot_reach_the_clouds_metadata_service(
    node: Node, metadata_service: tuple[str, str]
) -> None:
    """A link-local listener (169.254.169.254 answers a cloud node's machine with its credentials)
    is refused at once by the job's own routes; before, slirp4netns took the connection there."""
    ns, address = metadata_service
    with entered(ns):
        sock = socket.create_server((address, 0))
    imds = Listener(sock, b"NODE-CREDENTIALS")
    try:
        _, c = node.member("nm")
        dials = {"imds": ["inet", list(imds.address)], "alibaba": ["inet", ["100.100.100.200", 80]]}
        got = _run(node, c, [JOB_PYTHON, "-c", DIAL, json.dumps(dials)])
        assert got == dict.fromkeys(dials, "refused: [Errno 13] Permission denied"), got
        assert imds.accepted == 0
    finally:
        sock.close()
