"""Tenant B's process job takes every pty of the node.

The host's ptys are one count (kernel.pty.max, 4096 by default), and a process job opened
/dev/ptmx on the host's devpts: B's job held 4095 of them, after which `cpool exec -t` into A's
job, A's own terminals (`script`, pexpect) and the node's sshd all failed with ENOSPC. Each job now
has a devpts instance of its own, of at most sandbox.JOB_PTYS ptys, which together stay below the
host's reserve (kernel.pty.reserve) for the node's own terminals; `cpool exec -t` takes its pty in
the job's instance (test_exec.py::test_exec_with_a_terminal: `tty` still names it).
"""

from __future__ import annotations

import os
import pwd
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_node import sandbox_node

from computepool.agent import jobexec
from computepool.agent.executor import STDOUT_LOG, Executor, JobSpec, SandboxConfig
from computepool.agent.localstate import JobState
from computepool.agent.sandbox import JOB_PTYS
from computepool.agent.tenants import remove_tenant_user, user_name

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and namespaces need root")]

PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
RANGE = (61000, 61999)
HOG = r"""
import errno, os, time
fds = []
try:
    while len(fds) < 5000:
        fds.append(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY))
    why = "none"
except OSError as e:
    why = errno.errorcode[e.errno]
print("held", len(fds), why, flush=True)
time.sleep(120)
"""
VICTIM = r"""
import os
master, slave = os.openpty()
print("pty:", os.ttyname(slave), flush=True)
"""


@pytest.fixture
def node() -> Iterator[Executor]:
    with sandbox_node("pty", SandboxConfig(uid_range=RANGE), mode=0o755, cgroup_base=None) as ex:
        yield ex


def _held(ex: Executor, key: str, tenant: str) -> jobexec.HeldNamespaces:
    rec = next(r for r in ex.running() if r.key == key)
    init = None
    deadline = time.monotonic() + 30
    while init is None:
        assert time.monotonic() < deadline, "the job's sandbox never came up"
        init = jobexec.find_init(rec)
    view = jobexec.JobView(rec, init, Path(rec.run_dir) / "work", pwd.getpwnam(user_name(tenant)))
    return jobexec.hold_namespaces(view)


def test_a_job_holding_every_pty_it_can_leaves_the_node_and_other_tenants_theirs(node: Executor) -> None:
    a, b = f"ap{uuid.uuid4().hex[:6]}", f"bp{uuid.uuid4().hex[:6]}"
    try:
        hog = node.start(JobSpec("pty1", 1, [PY, "-c", HOG], tenant=b, memory_mib=256))
        out = Path(hog.run_dir) / STDOUT_LOG
        deadline = time.monotonic() + 60
        while "held" not in out.read_text():
            assert node.wait(hog.key, 0.1).state is JobState.RUNNING, out.read_text()
            assert time.monotonic() < deadline, "B's job never said what it held"
        master, slave = os.openpty()  # the node's own terminals (sshd, the agent)
        os.close(master)
        os.close(slave)
        done = node.wait(node.start(JobSpec("pty2", 1, [PY, "-c", VICTIM], tenant=a, memory_mib=64)).key, 60)
        said = (Path(done.run_dir) / STDOUT_LOG).read_text()
        assert done.state is JobState.SUCCEEDED, (
            done.reason,
            said,
            (Path(done.run_dir) / "stderr.log").read_text(),
        )
        assert said.startswith("pty: /dev/pts/"), said
        held = out.read_text().split()
        assert held[:3] == ["held", str(JOB_PTYS), "ENOSPC"], held  # its own instance's, no more
    finally:
        for t in (a, b):
            remove_tenant_user(t, RANGE)


def test_an_exec_terminal_is_one_of_the_jobs_own_ptys(node: Executor) -> None:
    """`cpool exec -t` takes its pty in the job's instance (its `tty` names it there), and a job
    that holds all of its own gets a one-line refusal, not one of the node's."""
    a, b = f"aq{uuid.uuid4().hex[:6]}", f"bq{uuid.uuid4().hex[:6]}"
    try:
        calm = node.start(JobSpec("pty3", 1, [PY, "-c", "import time; time.sleep(120)"], tenant=a))
        hog = node.start(JobSpec("pty4", 1, [PY, "-c", HOG], tenant=b, memory_mib=256))
        out = Path(hog.run_dir) / STDOUT_LOG
        deadline = time.monotonic() + 60
        while "held" not in out.read_text():
            assert time.monotonic() < deadline, "B's job never said what it held"
            time.sleep(0.05)
        with _held(node, calm.key, a) as held:
            master, slave = jobexec.open_pty(held)
            try:
                theirs = os.stat("dev/pts", dir_fd=held.root).st_dev
                assert os.fstat(slave).st_dev == theirs != os.stat("/dev/pts").st_dev
            finally:
                os.close(master)
                os.close(slave)
        with _held(node, hog.key, b) as held, pytest.raises(jobexec.ExecRefused, match="every terminal"):
            jobexec.open_pty(held)
    finally:
        for t in (a, b):
            remove_tenant_user(t, RANGE)
