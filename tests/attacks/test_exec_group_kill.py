"""An exec session's end kills whatever process group has its number, another tenant's too.

When a `cpool exec` command ended, the node reaped the session's first process (nsenter, root, on
the host) and only then, after draining the output for up to 2 s, sent SIGKILL to its process
group by number. A command that leaves a child in a session of its own holding its output (so the
drain waits) and nothing in its group left the number free all that while: on a host whose pids
wrap (32768 here; a tenant forks through them in seconds) another tenant's process that became a
group leader with that number was killed. The session's first process is now reaped only after
its group was signalled: its number cannot name anyone else's group before.

The test plays the wrap: as root it writes the kernel's last pid so that the next process, tenant
A's (a session leader, as a job's launcher or a `start_new_session` child is), takes the number.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import time
from collections.abc import Iterator

import psutil
import pytest
from e2e_helpers import cpool, wait_for
from job_node import Node, job_node

from computepool.agent.tenants import user_name

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and namespaces need a root agent"),
    pytest.mark.skipif(shutil.which("slirp4netns") is None, reason="a job's own network needs slirp4netns"),
]

LAST_PID = "/proc/sys/kernel/ns_last_pid"


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with job_node() as n:
        yield n


def _session_leader(agent: int, since: float) -> int | None:
    """The exec session's first process on the host: the agent's child running nsenter."""
    for p in psutil.Process(agent).children():
        try:
            if p.name() == "nsenter" and p.create_time() >= since - 1:
                return p.pid
        except psutil.Error:
            continue
    return None


def _as_tenant_with_pid(pid: int, uid: int) -> subprocess.Popen[bytes] | None:
    """A process of the tenant's user, a session leader, with this pid (None when another process
    on the host took the number first)."""
    with open(LAST_PID, "w") as f:
        f.write(str(pid - 1))
    proc = subprocess.Popen(["sleep", "30"], user=uid, group=uid, start_new_session=True)
    if proc.pid == pid:
        return proc
    proc.kill()
    proc.wait()
    return None


def _one_session(node: Node, alloc: int, tenant: str, uid_a: int) -> bool | None:
    """Run B's command in `alloc`; when its first process is gone, start A's process with its
    number. Whether A's process outlived the session (None: the number was taken first)."""
    # a child in a session of its own keeps the output open (the drain waits for it), nothing
    # stays in the session's group
    since = time.time()
    session = subprocess.Popen(
        cpool("exec", str(alloc), "--", "sh", "-c", "setsid sleep 6 & sleep 1"),
        env=node.cli_env(tenant), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    leader = wait_for("the session's first process", lambda: _session_leader(node.agent.pid, since), 30)
    wait_for("its end", lambda: not psutil.pid_exists(leader) or session.poll() is not None, 30)
    victim = _as_tenant_with_pid(leader, uid_a)
    _, err = session.communicate(timeout=60)
    assert session.returncode == 0, err
    if victim is None:
        return None
    time.sleep(0.5)
    alive = victim.poll() is None
    victim.kill()
    victim.wait()
    return alive


def test_the_end_of_an_exec_session_kills_no_other_tenants_group(node: Node) -> None:
    tenant_a, a = node.member("ga")
    tenant_b, b = node.member("gb")
    jobs = [(a, node.submit(a, ["sleep", "600"])), (b, node.submit(b, ["sleep", "600"]))]
    for client, alloc in jobs:
        wait_for(
            f"job {alloc}",
            lambda c=client, i=alloc: c.get(f"/api/v1/allocations/{i}").json()["state"] == "active",
            60,
            node.logs,
        )
    uid_a = pwd.getpwnam(user_name(tenant_a)).pw_uid
    for _ in range(3):  # the host may take the number first
        alive = _one_session(node, jobs[1][1], tenant_b, uid_a)
        if alive is not None:
            assert alive, "tenant A's process was killed by the end of B's exec session"
            break
    else:
        pytest.fail("the number was taken by another process on the host three times")
    for client, alloc in jobs:
        assert client.post(f"/api/v1/allocations/{alloc}/cancel").status_code == 200
