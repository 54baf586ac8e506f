"""Tenant B's container fills the node's TCP memory from its own network namespace.

`test_tcp_memory.py`'s attack from a container: on cgroup v1 a socket's buffers are charged only
where its creator's own memory cgroup has a TCP limit, and a container's own cgroup is runc's (a
parent's limit does not turn its child's on). B's container of 64 MiB, on `--network none`, held
about 300 MiB of the host's one TCP budget (net.ipv4.tcp_mem) in connections on its own loopback
to peers that never read. The agent's podman now runs a hook that gives each container's memory
cgroup a TCP limit of its memory limit before its command starts (container_tcp.py).
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest
from test_tcp_memory import FILL, MIB

from computepool.agent.container import Podman
from computepool.agent.executor import JobSpec

UID = 61993  # any uid: the container needs no passwd entry for it


def test_a_containers_tcp_buffers_are_held_by_its_memory_limit(image: str, tmp_path: Path) -> None:
    if not Path("/sys/fs/cgroup/memory/memory.kmem.tcp.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory controller: v2 charges sockets to a container's memory")
    podman = Podman(tmp_path / "agent", node_name=f"n{uuid.uuid4().hex[:6]}")
    ok, why = podman.available()  # as the agent at its start: writes podman's settings
    assert ok, why
    work = tmp_path / "run" / "work"
    work.mkdir(parents=True)
    os.chown(work, UID, UID)
    s = JobSpec("tcp2", 1, ["python3", "-c", FILL], tenant="acme", image=image, memory_mib=64)
    try:
        done = subprocess.run(
            podman.run_argv(s, work, UID, UID), capture_output=True, text=True, timeout=120, env={}, cwd=work,
            check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        held = int(done.stdout.split()[-1])
        assert MIB < held <= 96 * MIB, f"B's 64 MiB container holds {held / MIB:.0f} MiB of TCP memory"
    finally:
        for key in podman.all_keys():
            podman.remove(key)
