"""A process job reaches only the kernel calls an ordinary program needs.

A tenant's job ran `unshare -Urm true`: in a user namespace of its own it held every capability
again, over a fresh mount table, the first step of most container escapes; it could also use the
kernel keyrings (shared by uid), set its personality, and set up io_uring. The sandbox now runs the
job under a seccomp filter (agent/syscall_filter.py) that refuses them with EPERM, while threads,
subprocesses and everything else still work.
"""

from __future__ import annotations

import json
import os
import platform

import pytest
from e2e_helpers import JOB_PYTHON
from job_node import job_node

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the probe uses x86_64 syscall numbers"),
]

PROBE = r"""
import ctypes, errno, json, os, subprocess, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.personality.argtypes = [ctypes.c_ulong]  # as C passes it: the query is 0xffffffff, not -1
out = {}
def call(name, fn):
    ctypes.set_errno(0)
    r = fn()
    out[name] = "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
r = subprocess.run(["unshare", "-Urm", "true"], capture_output=True, text=True)
out["unshare -Urm true"] = "ok" if r.returncode == 0 else r.stderr.strip()
call("unshare(CLONE_NEWUSER)", lambda: libc.unshare(0x10000000))
call("keyctl(GET_KEYRING_ID)", lambda: libc.syscall(250, 0, -3, 1))  # the session keyring
call("add_key", lambda: libc.syscall(248, b"user", b"cpool-probe", b"x", 1, -3))
call("personality(ADDR_NO_RANDOMIZE)", lambda: libc.personality(0x0040000))
params = ctypes.create_string_buffer(120)
call("io_uring_setup", lambda: libc.syscall(425, 4, params))
seen = []
t = threading.Thread(target=lambda: seen.append("thread"))
t.start(); t.join()
seen.append(subprocess.run(["echo", "sub"], capture_output=True, text=True).stdout.strip())
out["thread and subprocess"] = seen
out["personality query"] = libc.personality(0xFFFFFFFF)
print(json.dumps(out), flush=True)
"""


def test_a_job_cannot_make_a_user_namespace_nor_use_keyrings() -> None:
    with job_node() as node:
        _, client = node.member("sys")
        aid = node.submit(client, [JOB_PYTHON, "-c", PROBE])
        job = node.ended(client, aid)
        logs = client.get(f"/api/v1/allocations/{aid}/logs").json()
        assert job["state"] == "released", f"{job}\n{logs}\n{node.logs()}"
        seen = json.loads(logs["stdout"]["data"].strip().splitlines()[-1])
        assert "Operation not permitted" in seen.pop("unshare -Urm true"), seen
        assert seen == {
            "unshare(CLONE_NEWUSER)": "EPERM",
            "keyctl(GET_KEYRING_ID)": "EPERM",
            "add_key": "EPERM",
            "personality(ADDR_NO_RANDOMIZE)": "EPERM",
            "io_uring_setup": "EPERM",
            "thread and subprocess": ["thread", "sub"],
            "personality query": 0,
        }, seen
