"""A container job reaches no more kernel code than a process job.

A process job's filter refuses a new user namespace, the kernel keyrings, personality changes and
io_uring (test_job_syscalls.py). A tenant that asked for an image instead got podman's default
profile: `unshare -Urn` gave its container every capability over a network stack of its own
(nf_tables, where local kernel exploits live) and `unshare -Urm` mounts; keyctl answered. The
agent now runs containers under podman's default profile plus the process jobs' refusals
(agent/container_seccomp.py), and threads and subprocesses still work.
"""

from __future__ import annotations

import json
import os
import platform
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_node import sandbox_node

from computepool.agent.executor import STDOUT_LOG, Executor, JobSpec, SandboxConfig
from computepool.agent.localstate import JobState
from computepool.agent.tenants import remove_tenant_user

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and rootful podman need root"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the probe uses x86_64 syscall numbers"),
]

PROBE = r"""
import ctypes, errno, json, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}
def call(name, fn):
    ctypes.set_errno(0)
    r = fn()
    out[name] = "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
for flags in ("-Urn", "-Urm"):
    r = subprocess.run(["unshare", flags, "true"], capture_output=True, text=True)
    out["unshare " + flags] = "ok" if r.returncode == 0 else r.stderr.strip()
call("keyctl(GET_KEYRING_ID)", lambda: libc.syscall(250, 0, -3, 1))  # the session keyring
call("add_key", lambda: libc.syscall(248, b"user", b"cpool-probe", b"x", 1, -3))
params = ctypes.create_string_buffer(120)
call("io_uring_setup", lambda: libc.syscall(425, 4, params))
seen = []
t = threading.Thread(target=lambda: seen.append("thread"))
t.start(); t.join()
seen.append(subprocess.run(["echo", "sub"], capture_output=True, text=True).stdout.strip())
out["thread and subprocess"] = seen
print(json.dumps(out), flush=True)
"""


@pytest.fixture
def node() -> Iterator[Executor]:
    """A sandboxing executor as a root agent has it; its containers, data and users go at the end."""
    with sandbox_node("csc", SandboxConfig(), cgroup_base=None, containers=True) as ex:
        yield ex


def test_a_container_cannot_make_a_user_namespace_nor_use_keyrings(node: Executor, image: str) -> None:
    tenant = f"sc{uuid.uuid4().hex[:6]}"
    try:
        spec = JobSpec("sc1", 1, ["python3", "-c", PROBE], tenant=tenant, image=image, memory_mib=256)
        done = node.wait(node.start(spec).key, 90)
        out = (Path(done.run_dir) / STDOUT_LOG).read_text()
        assert done.state is JobState.SUCCEEDED, (
            done.reason,
            out,
            (Path(done.run_dir) / "stderr.log").read_text(),
        )
        seen = json.loads(out.strip().splitlines()[-1])
        for flags in ("-Urn", "-Urm"):
            assert "Operation not permitted" in seen.pop("unshare " + flags), seen
        assert seen == {
            "keyctl(GET_KEYRING_ID)": "EPERM",
            "add_key": "EPERM",
            "io_uring_setup": "EPERM",
            "thread and subprocess": ["thread", "sub"],
        }, seen
    finally:
        remove_tenant_user(tenant)
