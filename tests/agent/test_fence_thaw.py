"""A fence supervisor thawed past its deadline: real processes frozen with SIGSTOP and thawed.

SIGKILL is due at deadline + grace whatever the time now, so a supervisor (and its job) frozen past
that moment kill at once, with no SIGTERM a job could handle while the pool runs its next attempt
elsewhere. A deadline that lapsed while they were frozen fences the job even when a heartbeat
answered after the thaw has moved the deadline on."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from computepool.agent import fencing
from computepool.agent.fencing import Contact, Target

HOUR = 3600.0

# handles SIGTERM (notes it in a file, runs on), as a job that checkpoints on SIGTERM would
HANDLER = (
    "import signal, sys, time\n"
    "def on_term(*_):\n"
    "    open(sys.argv[1], 'a').write('TERM\\n')\n"
    "signal.signal(signal.SIGTERM, on_term)\n"
    "open(sys.argv[2], 'w').write('up')\n"
    "while True:\n"
    "    time.sleep(0.05)\n"
)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    d = tmp_path / "agent"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        with contextlib.suppress(OSError):
            os.kill(p.pid, signal.SIGCONT)
        if p.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _wait(what: str, cond: Callable[[], object], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def _handler_job(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> tuple[subprocess.Popen[bytes], Path]:
    term, up = tmp_path / "term.txt", tmp_path / "up.txt"
    job = subprocess.Popen(
        [sys.executable, "-c", HANDLER, str(term), str(up)], start_new_session=True, cwd=tmp_path
    )
    procs.append(job)
    _wait("the job up", up.exists)
    return job, term


def _target(proc: subprocess.Popen[bytes], key: str) -> Target:
    return Target(key, proc.pid, psutil.Process(proc.pid).create_time(), proc.pid)


def _write_contact(data_dir: Path, deadline: float, lapsed: float | None = None) -> None:
    data = {"contact": deadline - 3.0, "deadline": deadline, "fence_s": 3.0, "lapsed": lapsed}
    (data_dir / fencing.CONTACT_FILE).write_text(json.dumps(data))


def _stopped(pid: int) -> bool:
    return psutil.Process(pid).status() == psutil.STATUS_STOPPED


def _freeze(*pids: int) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    _wait("frozen", lambda: all(_stopped(p) for p in pids))


def _thaw(*pids: int) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


def test_a_supervisor_thawed_past_deadline_and_grace_kills_at_once_without_sigterm(
    data_dir: Path, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    job, term = _handler_job(tmp_path, procs)
    _write_contact(data_dir, deadline=fencing.now_s() + 60)
    sup = fencing.spawn(data_dir, _target(job, "21#1"), grace_s=HOUR)  # a grace it must not wait out
    procs.append(sup)
    _wait("the supervisor watching", lambda: fencing.supervised(data_dir, "21#1"))
    _freeze(sup.pid, job.pid)
    # frozen for an hour and more, as far as the deadline is concerned
    _write_contact(data_dir, deadline=fencing.now_s() - HOUR - 1)
    _thaw(sup.pid, job.pid)
    job.wait(timeout=30)  # with SIGTERM and the full grace first, it would run on for an hour
    assert job.returncode == -signal.SIGKILL
    assert not term.exists(), "the fenced job was sent SIGTERM and ran its handler after its deadline"
    assert sup.wait(timeout=30) == 0
    reason = fencing.fenced_reason(data_dir, "21#1")
    assert reason is not None and reason.startswith(fencing.FENCED_PREFIX)


def test_sigkill_comes_at_deadline_plus_grace_not_a_whole_grace_after_the_thaw(
    data_dir: Path, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    job, term = _handler_job(tmp_path, procs)
    _write_contact(data_dir, deadline=fencing.now_s() + 60)
    sup = fencing.spawn(data_dir, _target(job, "22#1"), grace_s=HOUR)
    procs.append(sup)
    _wait("the supervisor watching", lambda: fencing.supervised(data_dir, "22#1"))
    _freeze(sup.pid, job.pid)
    _write_contact(data_dir, deadline=fencing.now_s() - HOUR + 1)  # 1 s of its grace left
    _thaw(sup.pid, job.pid)
    _wait("SIGTERM first, while some grace is left", term.exists)
    job.wait(timeout=30)  # SIGKILL at deadline + grace, not an hour after the thaw
    assert job.returncode == -signal.SIGKILL


def test_a_deadline_that_lapsed_while_frozen_fences_even_after_contact_is_back(
    data_dir: Path, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    procs.append(job)
    contact = Contact(data_dir, kill_grace_s=HOUR)
    contact.learn(2.0, 0.5)  # a 1 s fence
    contact.touch(fencing.now_s())
    deadline = contact.deadline()
    assert deadline is not None
    sup = fencing.spawn(data_dir, _target(job, "23#1"), grace_s=HOUR)
    procs.append(sup)
    _wait("the supervisor watching", lambda: fencing.supervised(data_dir, "23#1"))
    _freeze(sup.pid, job.pid)
    _wait("the deadline passed while frozen", lambda: fencing.now_s() > deadline + 0.05)
    contact.touch(fencing.now_s())  # a heartbeat answered at the thaw: the deadline moves on ...
    assert contact.lapsed == deadline and not contact.overdue()
    assert fencing.read_lapsed(contact.path) == deadline  # ... but the lapse is on record
    _thaw(sup.pid, job.pid)
    job.wait(timeout=30)  # it ran through the lapse: the pool may run it elsewhere now
    assert fencing.fenced_reason(data_dir, "23#1") is not None
    assert sup.wait(timeout=30) == 0


def test_a_job_started_after_a_lapse_is_left_alone(
    data_dir: Path, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    contact = Contact(data_dir, kill_grace_s=1.0)
    contact.learn(20.0, 1.0)
    old = fencing.now_s() - HOUR
    contact.touch(old, now=old)
    contact.touch(fencing.now_s())  # contact back after an hour: a lapse on record
    assert contact.lapsed is not None
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"], start_new_session=True)
    procs.append(job)
    sup = fencing.spawn(data_dir, _target(job, "24#1"), grace_s=1.0)
    procs.append(sup)
    assert sup.wait(timeout=30) == 0  # the supervisor leaves when the job ends by itself
    assert job.wait(timeout=30) == 0
    assert fencing.fenced_reason(data_dir, "24#1") is None


def test_when_the_kill_is_due() -> None:
    kill_at = fencing.fence_kill_at
    assert kill_at(deadline=100.0, lapsed=None, started=0.0, grace_s=10.0, now=99.0) is None
    assert kill_at(deadline=100.0, lapsed=None, started=0.0, grace_s=10.0, now=100.0) == 110.0
    assert kill_at(deadline=100.0, lapsed=None, started=0.0, grace_s=10.0, now=500.0) == 110.0
    # contact is back (deadline ahead), but the job ran through the lapse at 50
    assert kill_at(deadline=600.0, lapsed=50.0, started=10.0, grace_s=10.0, now=500.0) == 60.0
    assert kill_at(deadline=600.0, lapsed=50.0, started=55.0, grace_s=10.0, now=500.0) is None
    assert kill_at(deadline=None, lapsed=None, started=0.0, grace_s=10.0, now=500.0) is None


def test_a_heartbeat_answered_after_the_deadline_records_the_lapse(tmp_path: Path) -> None:
    c = Contact(tmp_path, kill_grace_s=2.0)
    c.learn(20.0, 1.0)
    fence = c.fence
    assert fence is not None
    c.touch(100.0, now=100.1)
    assert c.lapsed is None and c.rejoined is None
    c.touch(100.0 + fence - 1, now=100.0 + fence - 0.5)  # in time: no lapse
    assert c.lapsed is None
    # sent before the deadline, answered after it (the node froze mid-request): a lapse
    c.touch(100.0 + fence, now=100.0 + 2 * fence)
    assert c.lapsed == pytest.approx(100.0 + fence - 1 + fence) and c.rejoined == 100.0 + 2 * fence
    assert Contact(tmp_path, kill_grace_s=2.0).lapsed == c.lapsed  # kept for a restarted agent
