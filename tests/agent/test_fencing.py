"""The fence of restartable work: timeouts checked against each other, and the per-job supervisor
(a real process) that stops a real job once the node has been out of contact for the fence time."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from computepool.agent import fencing
from computepool.agent.fencing import Contact, FenceConfigError, Target, Timeouts


def test_the_default_fence_ends_work_before_the_node_can_be_declared_lost() -> None:
    t = Timeouts(lost_after_s=60, heartbeat_interval_s=5, kill_grace_s=10)
    t.check()
    assert t.effective_fence_s + t.grace_s + t.margin_s <= 60  # the margin keeps it strictly before
    assert t.effective_fence_s >= 2 * 5
    short = Timeouts(lost_after_s=6, heartbeat_interval_s=0.5, kill_grace_s=10)
    short.check()
    assert short.grace_s == 1.5  # a long kill grace is cut to a quarter of the timeout
    assert 0 < short.effective_fence_s < 6 - 1.5


def test_a_fence_that_could_let_two_copies_run_is_refused_naming_the_options() -> None:
    with pytest.raises(FenceConfigError, match=r"fence 55 s .* lost-node timeout 60 s.*--fence-s"):
        Timeouts(lost_after_s=60, heartbeat_interval_s=5, kill_grace_s=10, fence_s=55).check()
    with pytest.raises(FenceConfigError, match="shorter than two heartbeats"):
        Timeouts(lost_after_s=60, heartbeat_interval_s=5, kill_grace_s=10, fence_s=8).check()
    with pytest.raises(FenceConfigError, match="shorter than two heartbeats"):
        Timeouts(lost_after_s=1.6, heartbeat_interval_s=0.5, kill_grace_s=10).check()


def test_the_contact_file_is_private_and_its_deadline_only_moves_on(tmp_path: Path) -> None:
    c = Contact(tmp_path, kill_grace_s=2.0)
    assert c.deadline() is None and not c.overdue()  # timeouts unknown: nothing is fenced yet
    c.learn(20.0, 1.0)
    c.touch(100.0)
    fence = c.fence
    assert fence is not None
    assert fencing.read_deadline(c.path) == pytest.approx(100.0 + fence)
    assert stat.S_IMODE(c.path.stat().st_mode) == 0o600
    c.touch(50.0)  # an older heartbeat answered late never moves the deadline back
    assert c.deadline() == pytest.approx(100.0 + fence)
    again = Contact(tmp_path, kill_grace_s=2.0)  # a restarted agent remembers the server's timeouts
    assert again.deadline() == pytest.approx(100.0 + fence)
    assert again.overdue(now=100.0 + fence + 0.01) and not again.overdue(now=100.0 + fence - 0.01)
    with pytest.raises(FenceConfigError):
        c.learn(2.0, 1.0)


def _job(tmp_path: Path, code: str) -> subprocess.Popen[bytes]:
    """A stand-in for an executor's job: its own session and process group, with a child."""
    script = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {code!r}])\n{code}\n"
    return subprocess.Popen([sys.executable, "-c", script], start_new_session=True, cwd=tmp_path)


def _target(proc: subprocess.Popen[bytes], key: str = "7#1") -> Target:
    return Target(key, proc.pid, psutil.Process(proc.pid).create_time(), proc.pid)


def _group(pgid: int) -> set[int]:
    out = set()
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except (OSError, psutil.Error):
            continue
    return out


def _contact(data_dir: Path, deadline_in_s: float, fence_s: float = 3.0) -> None:
    data = {"contact": fencing.now_s(), "deadline": fencing.now_s() + deadline_in_s, "fence_s": fence_s}
    (data_dir / fencing.CONTACT_FILE).write_text(json.dumps(data))


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
        if p.poll() is None:
            for pid in _group(p.pid) | {p.pid}:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            p.wait()


def test_the_supervisor_kills_the_whole_job_once_the_deadline_passes(
    data_dir: Path, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    job = _job(tmp_path, "import time; time.sleep(120)")
    procs.append(job)
    time.sleep(0.3)
    assert len(_group(job.pid)) == 2
    _contact(data_dir, deadline_in_s=1.5)
    sup = fencing.spawn(data_dir, _target(job), grace_s=2.0)
    procs.append(sup)
    time.sleep(0.8)
    assert job.poll() is None, "fenced before the deadline"
    assert fencing.supervised(data_dir, "7#1")
    job.wait(timeout=10)  # fenced at its deadline: a job left alone would sleep on for minutes
    assert sup.wait(timeout=10) == 0
    time.sleep(0.1)
    assert _group(job.pid) == set(), "the job's child outlived the fence"
    reason = fencing.fenced_reason(data_dir, "7#1")
    assert reason is not None and reason.startswith(fencing.FENCED_PREFIX) and "3 s" in reason
    marker = data_dir / fencing.FENCE_DIR / "7.1.fenced"
    assert stat.S_IMODE(marker.stat().st_mode) == 0o600


def test_a_refreshed_deadline_keeps_the_job_and_sigterm_is_followed_by_sigkill(
    data_dir: Path, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    job = _job(tmp_path, stubborn)
    procs.append(job)
    _contact(data_dir, deadline_in_s=1.0)
    sup = fencing.spawn(data_dir, _target(job, "8#2"), grace_s=1.0)
    procs.append(sup)
    for _ in range(6):  # the agent's heartbeats keep moving the deadline on
        time.sleep(0.4)
        _contact(data_dir, deadline_in_s=1.0)
    assert job.poll() is None and sup.poll() is None
    assert fencing.fenced_reason(data_dir, "8#2") is None
    t0 = time.monotonic()
    job.wait(timeout=10)  # no more heartbeats: SIGTERM is ignored, SIGKILL follows the grace
    waited = time.monotonic() - t0
    assert job.returncode == -signal.SIGKILL
    assert 1.5 <= waited < 4.0
    assert fencing.fenced_reason(data_dir, "8#2") is not None


def test_the_supervisor_leaves_when_the_job_ends_and_fences_nothing(
    data_dir: Path, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"], start_new_session=True)
    procs.append(job)
    _contact(data_dir, deadline_in_s=60)
    sup = fencing.spawn(data_dir, _target(job, "9#1"), grace_s=1.0)
    procs.append(sup)
    job.wait(timeout=10)
    assert sup.wait(timeout=10) == 0
    assert fencing.fenced_reason(data_dir, "9#1") is None
    assert not fencing.supervised(data_dir, "9#1")


def test_the_supervisor_outlives_the_agent_that_started_it(
    data_dir: Path, tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """An 'agent' process spawns the supervisor and is killed with SIGKILL: the fence still holds."""
    job = _job(tmp_path, "import time; time.sleep(120)")
    procs.append(job)
    t = _target(job, "10#1")
    _contact(data_dir, deadline_in_s=2.0)
    agent_code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from computepool.agent import fencing\n"
        f"t = fencing.Target({t.key!r}, {t.pid}, {t.create_time!r}, {t.pgid})\n"
        f"fencing.spawn(Path({str(data_dir)!r}), t, 1.0)\n"
        "print('spawned', flush=True)\n"
        "time.sleep(120)\n"
    )
    agent = subprocess.Popen([sys.executable, "-c", agent_code], stdout=subprocess.PIPE)
    procs.append(agent)
    assert agent.stdout is not None and agent.stdout.readline().strip() == b"spawned"
    agent.kill()
    agent.wait()
    assert job.poll() is None
    job.wait(timeout=10)
    assert fencing.fenced_reason(data_dir, "10#1") is not None
