"""Local state: records survive the agent, and a restarted agent re-adopts what still runs."""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from pathlib import Path

import psutil

from computepool.agent.api import AgentApi
from computepool.agent.executor import Executor, JobSpec
from computepool.agent.localstate import _COLUMNS, _SCHEMA, JobRecord, JobState, LocalState, _encode
from computepool.agent.reports import Reporter


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


def _done(data: Path, n: int, tenant: str = "t1") -> list[JobRecord]:
    """`n` ended attempts the control plane has acknowledged, as a busy node accumulates them."""
    return [
        JobRecord(str(1000 + i), 1, ["true"], str(data / f"runs/{1000 + i}/1"), state=JobState.SUCCEEDED,
                  exit_code=0, started_at=1.0 + i, ended_at=2.0 + i, reported=True, extra={"tenant": tenant})
        for i in range(n)
    ]  # fmt: skip


def test_a_pass_reads_the_open_rows_alone(tmp_path: Path) -> None:
    """What the agent asks its local state on each pass (starts and ends to report) decodes the
    running and unacknowledged rows only, however many acknowledged ones are kept."""
    state = LocalState(tmp_path)
    for rec in _done(tmp_path, 2000):
        state.put(rec)
    live = JobRecord("live", 1, ["sleep", "9"], str(tmp_path / "runs/live/1"), pid=7, started_at=5.0)
    ended = JobRecord("end", 1, ["false"], str(tmp_path / "runs/end/1"), state=JobState.FAILED, exit_code=1)
    state.put(live)
    state.put(ended)
    executor = Executor(tmp_path, state, cgroup_base=None)
    api = AgentApi("http://127.0.0.1:9")  # never called: pending() is what a pass would send
    reporter = Reporter(api, executor, lambda what, e: None)
    assert reporter.acknowledged.keys() == {r.key for r in _done(tmp_path, 2000)}  # keys only, no records
    before = state.rows_read
    assert [k for k, _, _ in reporter.pending()] == ["end#1"]
    assert state.running() == [live] and state.open_jobs() == [ended, live]
    assert state.rows_read - before == 1 + 1 + 2  # pending(), running(), open_jobs(): open rows alone
    state.mark_reported("end#1")
    assert list(reporter.pending()) == [] and state.get("end#1").reported  # type: ignore[union-attr]
    state.mark_reported("live#1")  # a running attempt is never marked: its end is still to come
    assert state.running() == [live]
    api.close()
    state.close()


def test_acknowledged_ends_are_forgotten_once_the_pool_no_longer_assigns_them(tmp_path: Path) -> None:
    state = LocalState(tmp_path)
    done = _done(tmp_path, 3)
    for rec in done:
        state.put(rec)
    state.close()
    state = LocalState(tmp_path)  # a restarted agent: acknowledged before this run began
    api = AgentApi("http://127.0.0.1:9")  # never called: acknowledgements are given below
    reporter = Reporter(api, Executor(tmp_path, state, cgroup_base=None), lambda what, e: None)
    assert reporter.forget_done({done[0].key}, sent=1.0) == [done[1].key, done[2].key]
    assert state.known(done[0].key) and not state.known(done[1].key)  # still assigned: kept
    # an end acknowledged now: an answer asked for before that says nothing about it
    rec = JobRecord("9", 1, ["true"], str(tmp_path / "runs/9/1"), state=JobState.SUCCEEDED, exit_code=0)
    state.put(rec)
    reporter._acknowledged(rec.key, rec)
    at = reporter.acknowledged[rec.key]
    assert reporter.forget_done(set(), sent=at - 1.0) == [done[0].key]
    assert state.known(rec.key) and state.get(rec.key).reported  # type: ignore[union-attr]
    assert reporter.forget_done(set(), sent=at + 1.0) == [rec.key]
    assert state.jobs() == [] and reporter.acknowledged == {}
    assert state.tenants() == {"t1"}  # a non-root agent still refuses a second tenant (launch.py)
    api.close()
    state.close()


def test_a_state_file_of_an_earlier_agent_gains_the_index_and_its_tenants(tmp_path: Path) -> None:
    """The table an earlier agent wrote (no index, no tenants table) is upgraded once, in place."""
    rec = _done(tmp_path, 1, tenant="old")[0]
    rec.reported = False
    db = sqlite3.connect(tmp_path / "agent-state.db")
    db.execute(_SCHEMA)
    db.execute(f"INSERT INTO jobs VALUES ({', '.join('?' * (len(_COLUMNS) + 1))})", _encode(rec))
    db.commit()
    db.close()
    state = LocalState(tmp_path)
    assert state.unreported() == [rec] and state.tenants() == {"old"}
    plan = " ".join(
        str(r[-1])
        for r in state._db.execute("EXPLAIN QUERY PLAN SELECT * FROM jobs WHERE reported = 'false'")
    )
    assert "jobs_open" in plan, plan
    state.close()
