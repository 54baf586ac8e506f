"""Tenant B's job takes a count of the whole host (AIO events, open files), failing A's jobs.

`fs.aio-max-nr` counts the events of every process's AIO contexts (io_setup(2)) together, across
namespaces and cgroups. At its default, 65536, B's process job took it all with 16 contexts of
4096 events (2 MiB of memory) and held them: A's job's io_setup(128) then failed with EAGAIN
(libaio: DeepSpeed's NVMe offload, databases). A root agent now raises the limit to its memory / 32
(agent/host_limits.py); the rings are charged to the job's memory cgroup, so each job's memory
limit holds its share.

`fs.file-max` is the same kind of count: an unprivileged job forking children of 20000 open files
each took the host's 2.4 million (on a 24 GiB node, about 600 MiB of the job's memory) and every
other tenant's open, socket and pipe failed with ENFILE. Running that here would fail every test
running beside it, so the second test checks what holds it: once a root agent has started, no
job's memory can pay for the host's whole count of either kind.
"""

from __future__ import annotations

import os
import platform
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_node import sandbox_node

from computepool.agent.executor import STDOUT_LOG, Executor, JobSpec, SandboxConfig
from computepool.agent.host_limits import COUNTS, node_memory_bytes, wanted
from computepool.agent.localstate import JobState
from computepool.agent.tenants import remove_tenant_user

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and the host's limit need root"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the jobs use x86_64 syscall numbers"),
]

PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
RANGE = (61000, 61999)
SETUP = r"""
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def setup(n):
    ctx = ctypes.c_ulong(0)
    return "ok" if libc.syscall(206, n, ctypes.byref(ctx)) == 0 else errno.errorcode[ctypes.get_errno()]
"""
HOG = (
    SETUP
    + r"""
import time
held = 0
while held < 32 and setup(4096) == "ok":  # 131072 events: twice the default limit, 8 MiB of rings
    held += 1
print("held", held, flush=True)
time.sleep(120)
"""
)
VICTIM = SETUP + 'print("io_setup(128):", setup(128), flush=True)'


@pytest.fixture
def node() -> Iterator[Executor]:
    with sandbox_node("aio", SandboxConfig(uid_range=RANGE), mode=0o755) as ex:
        yield ex


def test_a_job_holding_every_aio_context_leaves_another_tenants_job_its_own(node: Executor) -> None:
    a, b = f"ao{uuid.uuid4().hex[:6]}", f"bo{uuid.uuid4().hex[:6]}"
    try:
        hog = node.start(JobSpec("aio1", 1, [PY, "-c", HOG], tenant=b, memory_mib=64))
        out = Path(hog.run_dir) / STDOUT_LOG
        deadline = time.monotonic() + 60
        while "held" not in out.read_text():
            assert node.wait(hog.key, 0.1).state is JobState.RUNNING, out.read_text()
            assert time.monotonic() < deadline, "B's job never said what it held"
        done = node.wait(node.start(JobSpec("aio2", 1, [PY, "-c", VICTIM], tenant=a, memory_mib=64)).key, 60)
        said = (Path(done.run_dir) / STDOUT_LOG).read_text()
        assert done.state is JobState.SUCCEEDED, (done.reason, said)
        assert said.strip() == "io_setup(128): ok", f"B's job: {out.read_text().strip()}; A's: {said.strip()}"
        assert out.read_text().split()[:2] == ["held", "32"]  # B got what its memory pays for
    finally:
        for t in (a, b):
            remove_tenant_user(t, RANGE)


def test_no_jobs_memory_pays_for_the_hosts_whole_count_of_files_or_aio_events(node: Executor) -> None:
    assert node_memory_bytes() > 0
    for count in COUNTS:  # each unit costs the taker's memory cgroup at least 2 x unit_bytes
        have = int(Path("/proc/sys", *count.sysctl.split(".")).read_text().split()[0])
        assert have >= wanted(count), f"{count.sysctl} = {have}: {count.what} once a job takes it all"
