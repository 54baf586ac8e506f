"""What a process job of tenant B can reach of the node it shares with A's container.

A job's mount namespace is a copy of the node's: its `mount` lists every mount of the node when it
started, A's container's root (overlay `…/merged`) and its /dev/shm among them, and the network
namespaces podman keeps under /run/netns. B's job tries to list each mount point, to join each of
those network namespaces (setns), and to read the environment of its namespace's init (root's,
holding the job's variables on their way to it). Nothing answers: podman's storage is root's
alone, setns is refused by the job's filter, and the init's environment is root's to read.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_node import sandbox_node

from computepool.agent.executor import STDOUT_LOG, Executor, JobSpec, SandboxConfig
from computepool.agent.localstate import JobState
from computepool.agent.tenants import remove_tenant_user

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and rootful podman need root")]

PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
LOOK = r"""
import ctypes, errno, glob, json, os
libc = ctypes.CDLL(None, use_errno=True)
out = {"listed": [], "joined": [], "storage mounts": 0}
for line in open("/proc/self/mountinfo"):
    point = line.split()[4]
    if "/containers/" in point:
        out["storage mounts"] += 1
        try:
            os.listdir(point)
            out["listed"].append(point)
        except OSError:
            pass
for ns in glob.glob("/run/netns/*"):
    try:
        fd = os.open(ns, os.O_RDONLY)
    except OSError:
        continue
    if libc.setns(fd, 0x40000000) == 0:
        out["joined"].append(ns)
    os.close(fd)
try:
    open("/proc/1/environ", "rb").read()
    out["init environ"] = "read"
except OSError as e:
    out["init environ"] = errno.errorcode[e.errno]
print(json.dumps(out), flush=True)
"""


@pytest.fixture
def node() -> Iterator[Executor]:
    with sandbox_node("view", SandboxConfig(), cgroup_base=None, containers=True) as ex:
        yield ex


def test_a_process_job_reaches_nothing_of_another_tenants_container_through_the_nodes_mounts(
    node: Executor, image: str
) -> None:
    a, b = f"va{uuid.uuid4().hex[:6]}", f"vb{uuid.uuid4().hex[:6]}"
    try:
        keep = "import time; print('ready', flush=True); time.sleep(120)"
        victim = node.start(
            JobSpec("view1", 1, ["python3", "-c", keep], tenant=a, image=image, memory_mib=128)
        )
        deadline = time.monotonic() + 90
        while "ready" not in (Path(victim.run_dir) / STDOUT_LOG).read_text():
            assert node.wait(victim.key, 0.1).state is JobState.RUNNING, victim.reason
            assert time.monotonic() < deadline, "A's container never came up"
        done = node.wait(
            node.start(JobSpec("view2", 1, [PY, "-c", LOOK], tenant=b, env={"B_SECRET": "x"})).key, 60
        )
        said = (Path(done.run_dir) / STDOUT_LOG).read_text()
        assert done.state is JobState.SUCCEEDED, (done.reason, said)
        seen = json.loads(said.strip().splitlines()[-1])
        assert seen["storage mounts"] >= 1, seen  # A's container's root is among B's mounts
        assert seen["listed"] == [] and seen["joined"] == [], seen
        assert seen["init environ"] == "EACCES", seen
        assert node.wait(victim.key, 0).state is JobState.RUNNING
    finally:
        for t in (a, b):
            remove_tenant_user(t)
