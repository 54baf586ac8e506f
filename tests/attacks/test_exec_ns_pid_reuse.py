"""`cpool exec` and `cpool forward` into a job whose namespaces' init pid is another tenant's by now.

The node found a job's namespace-holding process (its PID namespace's init) and then named it by
pid when it used it: `nsenter --target PID` for exec, `/proc/PID/ns/net` for forward. When the job
ended in between and another tenant's next process took the pid (a host whose pids wrap: a
tenant forks through 32768 in seconds), the session entered that tenant's namespaces: its shell,
its loopback services. The node now opens a pidfd first, checks that the pid is still a process
of the job, opens the namespace files and checks through the pidfd that the process still lives;
the command and the connection use those open files.

The test plays the wrap: as root it writes the kernel's last pid so that the next process, tenant
A's namespace holder with a service on its own loopback, takes the number of B's init.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import psutil
import pytest

from computepool.agent import jobexec
from computepool.agent.localstate import JobRecord
from computepool.agent.sandbox import HostSupport

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="namespaces and the kernel's last pid need root"),
    pytest.mark.skipif(
        shutil.which("unshare") is None or shutil.which("ip") is None, reason="util-linux, ip"
    ),
]

T = TypeVar("T")
LAST_PID = "/proc/sys/kernel/ns_last_pid"
# Tenant A's namespace holder: its own loopback up, a service on PORT that answers with a secret.
SERVICE = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(b"tenant-A-secret")
    c.close()
"""


@dataclass
class Job:
    proc: subprocess.Popen[bytes]
    view: jobexec.JobView


def _wait(what: str, check: Callable[[], T], timeout: float = 10.0) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def job_b(tmp_path: Path) -> Iterator[Job]:
    """Tenant B's job as the sandbox makes it: a leader, and under it an init of new PID and
    network namespaces that runs the command."""
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--net", "sh", "-c", "sleep 60 & wait"], start_new_session=True
    )
    rec = JobRecord(
        allocation_id=f"nsreuse-{uuid.uuid4().hex[:8]}", attempt=1, command=["sleep", "60"],
        run_dir=str(tmp_path), pid=proc.pid, pgid=proc.pid,
        create_time=psutil.Process(proc.pid).create_time(),
    )  # fmt: skip
    init = _wait("the job's init", lambda: jobexec.find_init(rec))
    yield Job(proc, jobexec.JobView(rec, init, tmp_path, pwd.getpwnam("nobody")))
    _kill_group(proc.pid)
    proc.wait()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _end_and_take_its_init(job: Job, port: int) -> subprocess.Popen[str]:
    """End B's job, then start A's namespace holder with the number of B's init."""
    init = job.view.init_pid
    assert init is not None
    _kill_group(job.proc.pid)
    job.proc.wait()
    _wait("the init's end", lambda: not psutil.pid_exists(init))
    for _ in range(5):  # another process on the host may take the number first
        with open(LAST_PID, "w") as f:
            f.write(str(init - 1))
        a = subprocess.Popen(
            ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec python3 -c "$0" "$1"', SERVICE,
             str(port)],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        if a.pid == init:
            assert a.stdout is not None and a.stdout.readline().strip() == "ready"
            return a
        a.kill()
        a.wait()
    pytest.fail("the number was taken by another process on the host five times")


def _host() -> HostSupport:
    return HostSupport(
        root=True, setpriv=shutil.which("setpriv"), unshare=shutil.which("unshare"), namespaces=True
    )


def test_exec_runs_in_the_jobs_own_namespaces(job_b: Job) -> None:
    init = job_b.view.init_pid
    with jobexec.hold_namespaces(job_b.view) as held:
        argv, env = jobexec.exec_argv(job_b.view, _host(), ["readlink", "/proc/self/ns/net"], False, held)
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == os.readlink(f"/proc/{init}/ns/net")
    assert held.fds == {}


def test_exec_never_enters_the_namespaces_of_a_process_that_took_the_jobs_init_pid(job_b: Job) -> None:
    a = _end_and_take_its_init(job_b, 41000 + os.getpid() % 1000)
    try:
        with pytest.raises(jobexec.ExecRefused, match="ended"):
            jobexec.hold_namespaces(job_b.view)
    finally:
        a.kill()
        a.wait()


def test_forward_never_reaches_the_loopback_of_a_process_that_took_the_jobs_init_pid(job_b: Job) -> None:
    port = 42000 + os.getpid() % 1000
    a = _end_and_take_its_init(job_b, port)
    try:
        try:
            sock = jobexec.connect_in_job(job_b.view, port)
        except jobexec.ExecRefused as e:
            assert "ended" in str(e)
        else:
            with sock:
                got = sock.recv(100)
            pytest.fail(f"B's forward reached tenant A's loopback service: {got!r}")
    finally:
        a.kill()
        a.wait()
