"""A job's end signals the process group with its number after its leader is gone: another
tenant's group by then.

After an agent restart the node's jobs are adopted: their leaders are no longer the agent's
children, anyone may reap them. The end of such a job sent SIGKILL to its process group by
number whenever no process had the leader's pid. Once the job's group is empty the number is free:
another tenant's process that takes the pid, makes a group of its own, forks a worker and exits
leaves a group with that number and no process with that pid, and the whole group was killed.
Now the group is signalled by number only while its leader is the agent's own unreaped child;
otherwise only the job's cgroup, or without one, members checked through a pidfd to be the job's
(its user's, started no earlier than it).

The test plays the wrap: as root it writes the kernel's last pid so that tenant A's next process
takes the number of B's job's group.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from computepool.agent.localstate import JobRecord
from computepool.agent.outcome import kill_leftovers

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="other users and the kernel's last pid need root")

LAST_PID = "/proc/sys/kernel/ns_last_pid"
UID_B = pwd.getpwnam("nobody").pw_uid
UID_A = 61000 + os.getpid() % 1000  # another tenant's user (no name needed)


def _wait(what: str, check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def _group_with_a_worker(uid: int, pid: int | None = None) -> tuple[int, float, int] | None:
    """A group of `uid`'s whose leader (with pid `pid`, when given) started a worker and exited
    (reaped): the leader's pid and start time, and the worker's pid. None: the pid was taken."""
    if pid is not None:
        with open(LAST_PID, "w") as f:
            f.write(str(pid - 1))
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 30 & echo $!; read _"], user=uid, group=uid, start_new_session=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert leader.stdout is not None and leader.stdin is not None
    worker = int(leader.stdout.readline())
    started = psutil.Process(leader.pid).create_time()
    leader.stdin.close()
    leader.wait()
    if pid is not None and leader.pid != pid:
        os.kill(worker, signal.SIGKILL)
        return None
    return leader.pid, started, worker


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _record(tmp_path: Path, pid: int, started: float) -> JobRecord:
    """B's adopted job: no cgroup (the node's fallback), its leader no child of this process."""
    return JobRecord(
        allocation_id=f"reuse-{uuid.uuid4().hex[:8]}", attempt=1, command=["sleep", "30"],
        run_dir=str(tmp_path), pid=pid, pgid=pid, create_time=started, extra={"user": "nobody"},
    )  # fmt: skip


def test_the_end_of_an_adopted_job_kills_no_group_that_took_its_number(tmp_path: Path) -> None:
    made = _group_with_a_worker(UID_B)
    assert made is not None
    pid, started, worker_b = made
    rec = _record(tmp_path, pid, started)
    os.kill(worker_b, signal.SIGKILL)  # B's job ended: its group is empty, the number free
    _wait("B's worker's end", lambda: not psutil.pid_exists(worker_b))
    for _ in range(5):  # another process on the host may take the number first
        taken = _group_with_a_worker(UID_A, pid)
        if taken is not None:
            break
    else:
        pytest.fail("the number was taken by another process on the host five times")
    worker_a = taken[2]
    try:
        assert os.getpgid(worker_a) == pid  # A's group has B's old number, and no leader
        kill_leftovers(rec)
        time.sleep(0.2)
        assert _alive(worker_a), "tenant A's process was killed by the end of B's job"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker_a, signal.SIGKILL)


def test_what_an_adopted_job_left_in_its_group_is_still_killed(tmp_path: Path) -> None:
    made = _group_with_a_worker(UID_B)
    assert made is not None
    pid, started, worker = made
    try:
        kill_leftovers(_record(tmp_path, pid, started))
        _wait("the job's worker's end", lambda: not _alive(worker), 5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
