"""Tenant B's process job fills the node's TCP memory from its own network namespace.

The kernel keeps one TCP memory budget for the whole host (net.ipv4.tcp_mem), whatever the network
namespace: past its last figure no TCP socket of the node gets memory (the agent's connection to
the control plane, A's replicas, sshd). On cgroup v1 a job's TCP buffers were charged to nothing:
B's job of 64 MiB opened connections on its own loopback to peers that never read and held about
300 MiB in their buffers, a seventh of this node's budget; a few such jobs took it all. A v1 job
cgroup now gets a TCP limit of its memory limit (memory.kmem.tcp.limit_in_bytes), which turns the
charging on; cgroup v2 charges sockets to the job's memory anyway.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_node import sandbox_node

from computepool.agent.executor import STDOUT_LOG, Executor, JobSpec, SandboxConfig
from computepool.agent.localstate import JobState
from computepool.agent.tenants import remove_tenant_user

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="tenant users, namespaces and cgroups need root")]

PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
RANGE = (61000, 61999)
MIB = 1 << 20
FILL = r"""
import socket
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(128)
held, pairs = 0, []
for _ in range(80):
    c = socket.create_connection(listener.getsockname())
    peer, _ = listener.accept()  # never reads
    c.setblocking(False)
    try:
        while True:
            held += c.send(b"x" * 65536)
    except (BlockingIOError, OSError):
        pass
    pairs.append((c, peer))
print(held, flush=True)
"""


@pytest.fixture
def node() -> Iterator[Executor]:
    with sandbox_node("tcp", SandboxConfig(uid_range=RANGE), mode=0o755) as ex:
        yield ex


def test_a_jobs_tcp_buffers_are_held_by_its_memory_limit(node: Executor) -> None:
    b = f"tc{uuid.uuid4().hex[:6]}"
    try:
        done = node.wait(node.start(JobSpec("tcp1", 1, [PY, "-c", FILL], tenant=b, memory_mib=64)).key, 120)
        said = (Path(done.run_dir) / STDOUT_LOG).read_text()
        assert done.state is JobState.SUCCEEDED, (
            done.reason,
            said,
            (Path(done.run_dir) / "stderr.log").read_text(),
        )
        held = int(said.split()[-1])
        assert MIB < held <= 96 * MIB, f"B's 64 MiB job holds {held / MIB:.0f} MiB of TCP memory"
    finally:
        remove_tenant_user(b, RANGE)
