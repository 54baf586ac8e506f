"""Tenants' process jobs share no SysV IPC object and no POSIX message queue, and leave none behind.

Tenant B's job once created a SysV shared memory segment, a SysV message queue and a POSIX message
queue, mode 0666, under the key and name tenant A's program uses; A's job opened them the ordinary
way (IPC_CREAT / O_CREAT, mode 0600: the kernel keeps an existing object's mode) and wrote its
secret; B's next job read it. Every object also outlived its job (a 200 MiB segment stayed
resident), and /proc/sysvipc listed every tenant's keys. Each job now has an IPC namespace of its
own (sandbox.py, `unshare --ipc`): its objects are its own, and die with it.
"""

from __future__ import annotations

import ctypes
import json
import os
import pwd
import random
import subprocess
import uuid
from collections.abc import Iterator

import httpx
import pytest
from e2e_helpers import JOB_PYTHON
from job_node import Node, job_node

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent")]

# argv: mode (plant | use | steal), the SysV key of the segment, of the queue, of a big segment
# that B leaves behind, and the POSIX queue's name.
IPC = r"""
import ctypes, json, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
rt = ctypes.CDLL("librt.so.1", use_errno=True)
rt.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
class M(ctypes.Structure):
    _fields_ = [("t", ctypes.c_long), ("b", ctypes.c_char * 32)]
mode, mq = sys.argv[1], sys.argv[5].encode()
key, qkey, big = (int(k) for k in sys.argv[2:5])
CREAT, RDWR, NOWAIT = 0o1000, 2, 0o4000
if mode == "plant":
    libc.umask(0)
    made = [libc.shmget(key, 4096, CREAT | 0o666), libc.msgget(qkey, CREAT | 0o666),
            rt.mq_open(mq, 0o100 | RDWR, 0o666, None)]
    b = libc.shmget(big, 16 << 20, CREAT | 0o600)
    ctypes.memset(libc.shmat(b, None, 0), 1, 16 << 20)
    print(json.dumps({"made": [x >= 0 for x in made + [b]]}), flush=True)
elif mode == "use":
    ctypes.memmove(libc.shmat(libc.shmget(key, 4096, CREAT | 0o600), None, 0), b"A-SECRET", 8)
    libc.msgsnd(libc.msgget(qkey, CREAT | 0o600), ctypes.byref(M(1, b"A-SECRET")), 32, NOWAIT)
    rt.mq_send(rt.mq_open(mq, 0o100 | RDWR, 0o600, None), b"A-SECRET", 8, 0)
    print(json.dumps({"used": True}), flush=True)
else:
    got = []
    sid = libc.shmget(key, 0, 0)
    if sid >= 0:
        p = libc.shmat(sid, None, 0)
        if p not in (None, 2**64 - 1):
            got.append(ctypes.string_at(p, 8).decode(errors="replace"))
    m = M()
    if libc.msgrcv(libc.msgget(qkey, 0), ctypes.byref(m), 32, 0, NOWAIT) > 0:
        got.append(m.b.decode(errors="replace"))
    buf = ctypes.create_string_buffer(8192)
    q = rt.mq_open(mq, RDWR | NOWAIT, 0, None)
    n = rt.mq_receive(q, buf, 8192, None) if q >= 0 else -1
    if n > 0:
        got.append(buf.raw[:n].decode(errors="replace"))
    listed = [ln.split()[0] for f in ("shm", "msg") for ln in open("/proc/sysvipc/" + f).readlines()[1:]]
    print(json.dumps({"got": got, "listed": listed}), flush=True)
"""


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with job_node() as n:
        yield n


def _sysvipc(kind: str) -> list[list[str]]:
    with open(f"/proc/sysvipc/{kind}") as f:
        return [ln.split() for ln in f.read().splitlines()[1:]]


def _run(node: Node, client: httpx.Client, args: list[str]) -> dict[str, object]:
    aid = node.submit(client, [JOB_PYTHON, "-c", IPC, *args])
    job = node.ended(client, aid)
    out = client.get(f"/api/v1/allocations/{aid}/logs").json()["stdout"]["data"]
    assert job["state"] == "released", f"{job}\n{out}\n{node.logs()}"
    return dict(json.loads(out.strip().splitlines()[-1]))


def test_a_tenant_reads_nothing_through_ipc_objects_it_planted_and_leaves_none_behind(node: Node) -> None:
    ta, a = node.member("ia")
    tb, b = node.member("ib")
    base = random.randrange(0x10000000, 0x7FFF0000)  # keys and a name of this test's own
    keys = [str(base), str(base + 1), str(base + 2)]
    mq = f"/cpool-ipc-{uuid.uuid4().hex[:8]}"
    try:
        planted = _run(node, b, ["plant", *keys, mq])
        assert planted["made"] == [True] * 4, planted  # B may make them: in its own namespace
        assert _run(node, a, ["use", *keys, mq]) == {"used": True}
        stolen = _run(node, b, ["steal", *keys, mq])
        assert stolen == {"got": [], "listed": []}, stolen  # nothing of A's, nor of anyone's, listed
        # nothing of either tenant's jobs is left on the host: no object of their users, no key
        uids = {str(pwd.getpwnam(f"cpool-{t}").pw_uid) for t in (ta, tb)}
        left = [r for k in ("shm", "msg") for r in _sysvipc(k) if r[7] in uids or r[0] in keys]  # 7: uid
        assert left == [], left
        rt = ctypes.CDLL("librt.so.1", use_errno=True)
        rt.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
        assert rt.mq_open(mq.encode(), 0, 0, None) < 0 and ctypes.get_errno() == 2  # ENOENT: no queue
    finally:  # what the jobs left on the host before the fix
        for kind, flag in (("shm", "-m"), ("msg", "-q")):
            for r in _sysvipc(kind):
                if r[0] in keys:
                    subprocess.run(["ipcrm", flag, r[1]], check=False)
        ctypes.CDLL("librt.so.1").mq_unlink(mq.encode())
