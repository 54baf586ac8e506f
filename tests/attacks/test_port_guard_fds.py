"""Tenant B's job multiplies its descriptors so that the node's port guard spends the node's CPU.

Every two seconds the port guard (agent/port_guard.py) read the name of every descriptor of every
running job's processes, as root and outside any job's cgroup, and copied each socket it had not
placed (pidfd_getfd), again every third pass. Descriptors cost a job next to nothing (20000 per
process, all of one file: a few MiB of memory for 200,000), and looking through those of ten such
processes took the agent over a second of CPU a pass. Only a process in the node's network
namespace can hold a port of the node: the guard now reads no other's descriptors, while a job on
the node's network (a gang member, a replica) is still looked through.
"""

from __future__ import annotations

import os
import pwd
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from sandbox_node import sandbox_node

from computepool.agent.executor import STDOUT_LOG, Executor, JobSpec, SandboxConfig
from computepool.agent.localstate import JobState
from computepool.agent.port_guard import GuardedJob, PortGuard, PortRange
from computepool.agent.tenants import remove_tenant_user, user_name

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and namespaces need root")]

PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
RANGE = (61000, 61999)
HOG = r"""
import os, socket, time
for _ in range(4):
    if os.fork() == 0:
        break
s = socket.socket()
for _ in range(2000):
    os.dup(s.fileno())
print("ready", flush=True)
time.sleep(120)
"""


@pytest.fixture
def node() -> Iterator[Executor]:
    with sandbox_node("pgf", SandboxConfig(uid_range=RANGE), mode=0o755, cgroup_base=None) as ex:
        yield ex


def _ready(ex: Executor, key: str, run_dir: str, count: int) -> None:
    out = Path(run_dir) / STDOUT_LOG
    deadline = time.monotonic() + 60
    while out.read_text().count("ready") < count:
        assert ex.wait(key, 0.1).state is JobState.RUNNING, out.read_text()
        assert time.monotonic() < deadline, f"{key} never came up"


def test_the_port_guard_reads_no_descriptor_of_a_job_with_a_network_of_its_own(node: Executor) -> None:
    b = f"pg{uuid.uuid4().hex[:6]}"
    try:
        own = node.start(JobSpec("pgf1", 1, [PY, "-c", HOG], tenant=b, memory_mib=256))
        gang = node.start(JobSpec("pgf2", 1, [PY, "-c", HOG], tenant=b, memory_mib=256, host_network=True))
        _ready(node, own.key, own.run_dir, 5)
        _ready(node, gang.key, gang.run_dir, 5)
        jobs = [GuardedJob(k, frozenset(), frozenset(node.job_pids(k))) for k in (own.key, gang.key)]
        guard = PortGuard(lambda: jobs, lambda key, why: None, kernel_picks=set())
        guard.set_ranges((PortRange("service", 21000, 21999),))
        uid = pwd.getpwnam(user_name(b)).pw_uid
        bs = [
            {p for p in job.pids if psutil.Process(p).uids().real == uid} for job in jobs
        ]  # B's, not root's
        assert len(bs[0]) == len(bs[1]) == 5, bs
        for _ in range(RETRY_PASSES):
            assert guard.scan() == []
            assert guard.read_pids.isdisjoint(bs[0]), "the own-network job's descriptors were read"
        assert bs[1] <= guard.read_pids, "the job on the node's network must still be looked through"
    finally:
        remove_tenant_user(b, RANGE)


RETRY_PASSES = 4  # past RETRY_UNPLACED_PASSES: the passes that looked again at unplaced sockets
