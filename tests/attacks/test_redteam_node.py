"""A process job of tenant B against a running process job of tenant A on the same root agent.

A's job leaves a secret in its environment, its private /tmp, /var/tmp and /dev/shm and its
tenant's cache, then waits. B's job then: signals every
process id it can name, and every process at once (`kill(-1, SIGKILL)`); opens every file of the
pool's cgroups for writing (freezing, killing or starving A's job from there); looks for A's files
in /tmp, /dev/shm, /var/tmp and A's cache; and reads the environment, command line and mount table
of every process it can see. Nothing may succeed or show A's secret, and A's job runs on.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator

import pytest
from e2e_helpers import JOB_PYTHON, wait_for
from job_node import Node, job_node

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent")]

VICTIM = r"""
import os, sys, time
secret, name, cache = os.environ["A_SECRET"], sys.argv[1], os.environ["CPOOL_CACHE_DIR"]  # victim-code
for d in ("/tmp", "/dev/shm", "/var/tmp", cache):
    with open(os.path.join(d, name), "w") as f:
        f.write(secret)
print("ready", flush=True)
time.sleep(600)
"""

ATTACK = r"""
import errno, json, os, signal, sys
name, cache_a = sys.argv[1], sys.argv[2]
out = {"succeeded": [], "seen": []}
me = os.getpid()
for pid in range(2, 4096):  # every process id of this namespace (the init, pid 1, is root's)
    if pid != me:
        try:
            os.kill(pid, signal.SIGSTOP)
            out["succeeded"].append(f"SIGSTOP {pid}")
        except OSError:
            pass
written = 0
for top in os.listdir("/sys/fs/cgroup"):
    for root, dirs, files in os.walk(os.path.join("/sys/fs/cgroup", top)):
        if "computepool" not in root:
            continue
        for f in files:
            try:
                fd = os.open(os.path.join(root, f), os.O_WRONLY)
                os.close(fd)
                out["succeeded"].append("write " + os.path.join(root, f))
            except OSError:
                written += 1
out["cgroup files tried"] = written
for d in ("/tmp", "/dev/shm", "/var/tmp", cache_a):
    path = os.path.join(d, name)
    try:
        with open(path) as f:
            out["succeeded"].append(f"read {path}: {f.read()[:80]}")
    except OSError as e:
        out[path] = errno.errorcode[e.errno]
    try:
        os.unlink(path)
        out["succeeded"].append(f"unlink {path}")
    except OSError:
        pass
    try:
        if name in os.listdir(d):
            out["seen"].append(d)
    except OSError:
        pass
for p in os.listdir("/proc"):
    if not p.isdigit():
        continue
    for what in ("environ", "cmdline", "mountinfo"):
        try:
            with open(f"/proc/{p}/{what}", "rb") as f:
                data = f.read()
                if b"A_" + b"SECRET=" in data or b"victim" + b"-code" in data:  # not this code itself
                    out["seen"].append(f"/proc/{p}/{what}")
        except OSError:
            pass
try:
    os.kill(-1, signal.SIGKILL)  # every process this one may signal, itself spared: ends B's own job
except OSError as e:
    out["kill -1"] = errno.errorcode[e.errno]
print(json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with job_node() as n:
        yield n


def test_a_job_reaches_nothing_of_another_tenants_running_job(node: Node) -> None:
    name = f"f-{uuid.uuid4().hex[:8]}"
    ta, a = node.member("na")
    _, b = node.member("nb")
    secret = f"s-{uuid.uuid4().hex}"
    victim = node.submit(a, [JOB_PYTHON, "-c", VICTIM, name], env={"A_SECRET": secret})
    wait_for(
        "A's job",
        lambda: "ready" in a.get(f"/api/v1/allocations/{victim}/logs").json()["stdout"]["data"],
        60,
        node.logs,
    )
    cache_a = f"/var/cache/computepool/{ta}"
    attack = node.submit(b, [JOB_PYTHON, "-c", ATTACK, name, cache_a])
    node.ended(b, attack)
    logs = b.get(f"/api/v1/allocations/{attack}/logs").json()
    lines = [ln for ln in logs["stdout"]["data"].splitlines() if ln.startswith("{")]
    assert lines, f"{logs}\n{node.logs()}"
    out = json.loads(lines[-1])
    assert out["succeeded"] == [] and out["seen"] == [], out
    assert out["/tmp/" + name] == out["/dev/shm/" + name] == out["/var/tmp/" + name] == "ENOENT", out
    assert out[f"{cache_a}/{name}"] == "ENOENT", out  # the tenants' caches' root is covered: B sees no A
    # A's job runs on, its files intact
    assert a.get(f"/api/v1/allocations/{victim}").json()["state"] == "active"
    assert (node.agent_dir / "runs" / str(victim)).exists()
    assert not os.path.exists(f"/var/tmp/{name}")  # A's /var/tmp is its own, not the host's
    assert a.post(f"/api/v1/allocations/{victim}/cancel").status_code == 200
