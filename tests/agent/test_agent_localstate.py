"""Local state: records survive the agent, and a restarted agent re-adopts what still runs."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil

from computepool.agent.executor import Executor, JobSpec
from computepool.agent.localstate import JobRecord, JobState, LocalState


def _ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _restart(data_dir: Path, old: Executor) -> Executor:
    """What an agent restart leaves: the data dir, nothing in memory."""
    old.state.close()
    return Executor(data_dir, cgroup_base=None, kill_grace_s=2.0)


def test_records_round_trip_and_reporting(tmp_path: Path) -> None:
    state = LocalState(tmp_path)
    rec = JobRecord("a", 1, ["echo", "hi"], str(tmp_path / "run"), pid=42, create_time=1.5, extra={"k": "v"})
    state.put(rec)
    assert state.get("a#1") == rec and state.running() == [rec]
    rec.state, rec.exit_code, rec.ended_at = JobState.SUCCEEDED, 0, time.time()
    state.put(rec)
    assert [r.key for r in state.unreported()] == ["a#1"]
    state.mark_reported("a#1")
    assert state.unreported() == [] and state.get("a#1").reported  # type: ignore[union-attr]
    state.close()
    again = LocalState(tmp_path)
    assert again.get("a#1").state is JobState.SUCCEEDED  # type: ignore[union-attr]
    again.forget("a#1")
    assert again.jobs() == []
    again.close()


def test_restarted_agent_readopts_a_running_job(tmp_path: Path) -> None:
    data = tmp_path / "agent"
    first = Executor(data, cgroup_base=None)
    rec = first.start(JobSpec("long", 1, ["sh", "-c", "while [ ! -e go ]; do sleep 0.05; done; exit 0"]))
    second = _restart(data, first)
    del first
    report = second.adopt()
    assert [r.key for r in report.adopted] == [rec.key] and report.ended == []
    assert second.running()[0].pid == rec.pid  # the same process, not a new one
    assert second.start(JobSpec("long", 1, ["sh", "-c", "exit 9"])).pid == rec.pid  # not started twice
    assert second.adopt().adopted == []  # idempotent
    (Path(rec.run_dir) / "go").touch()
    done = second.wait(rec.key, 10)
    assert (done.state, done.exit_code, done.pid) == (JobState.SUCCEEDED, 0, rec.pid)
    assert [r.key for r in second.state.unreported()] == [rec.key]
    second.state.close()


def test_restarted_agent_can_stop_an_adopted_job(tmp_path: Path) -> None:
    data = tmp_path / "agent"
    first = Executor(data, cgroup_base=None)
    rec = first.start(JobSpec("adopted", 1, ["sleep", "60"]))
    second = _restart(data, first)
    second.adopt()
    done = second.kill(rec.key, "attempt no longer owned", grace_s=2)
    assert (done.state, done.reason) == (JobState.KILLED, "attempt no longer owned")
    second.state.close()


def test_jobs_that_ended_while_the_agent_was_away_are_reported(tmp_path: Path) -> None:
    data = tmp_path / "agent"
    first = Executor(data, cgroup_base=None)
    quick = first.start(JobSpec("quick", 1, ["sh", "-c", "exit 4"]))
    killed = first.start(JobSpec("sigkilled", 1, ["sleep", "60"]))
    os.killpg(killed.pgid, signal.SIGKILL)  # e.g. the kernel, while nobody watched
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(_ended(r.pid) for r in (quick, killed)):
            break
        time.sleep(0.02)
    second = _restart(data, first)
    report = second.adopt()
    ended = {r.allocation_id: r for r in report.ended}
    assert report.adopted == []
    assert (ended["quick"].state, ended["quick"].exit_code, ended["quick"].reason) == (
        JobState.FAILED,
        4,
        "exit code 4",
    )
    assert ended["sigkilled"].state is JobState.LOST
    assert {r.key for r in second.state.unreported()} == {quick.key, killed.key}
    assert second.poll() == []  # reported through adopt(), not twice
    second.state.close()


def test_a_reused_pid_is_not_adopted(tmp_path: Path) -> None:
    data = tmp_path / "agent"
    state = LocalState(data)
    me = psutil.Process()
    # our own (live) pid, but recorded with another start time: some earlier process's record
    state.put(JobRecord("old", 1, ["x"], str(data / "runs/old/1"), pid=me.pid, pgid=me.pid, create_time=1.0))
    state.close()
    ex = Executor(data, cgroup_base=None)
    report = ex.adopt()
    assert report.adopted == [] and [r.state for r in report.ended] == [JobState.LOST]
    assert me.is_running()  # and nothing was signalled
    ex.state.close()
