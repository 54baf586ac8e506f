"""The executor with real child processes: exit codes, logs, limits, group kill, clean failures."""

from __future__ import annotations

import os
import pwd
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from computepool.agent import cgroups
from computepool.agent.executor import STDERR_LOG, STDOUT_LOG, CgroupV1, CgroupV2, Executor, JobSpec
from computepool.agent.localstate import JobState


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_for_file(path: Path, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.02)
    raise AssertionError(f"{path} never appeared")


def test_exit_codes_logs_and_env(executor: Executor, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPOOL_AGENT_SECRET", "do-not-leak")
    script = 'echo "out $CPOOL_SLICE_VAR ${CPOOL_AGENT_SECRET:-none}"; echo err >&2; exit "$1"'
    ok = executor.start(JobSpec("ok", 1, ["sh", "-c", script, "sh", "0"], env={"CPOOL_SLICE_VAR": "v1"}))
    bad = executor.start(JobSpec("bad", 1, ["sh", "-c", script, "sh", "3"]))
    ok_rec, bad_rec = executor.wait(ok.key, 10), executor.wait(bad.key, 10)
    assert (ok_rec.state, ok_rec.exit_code, ok_rec.reason) == (JobState.SUCCEEDED, 0, "")
    assert (bad_rec.state, bad_rec.exit_code, bad_rec.reason) == (JobState.FAILED, 3, "exit code 3")
    run_dir = Path(ok_rec.run_dir)
    assert (run_dir / STDOUT_LOG).read_text() == "out v1 none\n"
    assert (run_dir / STDERR_LOG).read_text() == "err\n"
    assert ok_rec.started_at <= ok_rec.ended_at  # type: ignore[operator]
    assert {r.key for r in executor.poll()} == {ok.key, bad.key}
    assert executor.poll() == []
    assert executor.state.get(ok.key) == ok_rec


def test_command_not_found_is_a_recorded_failure(executor: Executor) -> None:
    rec = executor.start(JobSpec("nf", 1, ["no-such-command-xyz", "--flag"]))
    assert (rec.state, rec.exit_code, rec.reason) == (
        JobState.FAILED,
        127,
        "command not found: no-such-command-xyz",
    )
    assert executor.state.get(rec.key).reason == rec.reason  # type: ignore[union-attr]
    assert [r.key for r in executor.poll()] == [rec.key]
    empty = executor.start(JobSpec("empty", 1, []))
    assert (empty.state, empty.reason) == (JobState.FAILED, "empty command")


def test_start_is_idempotent_while_running(executor: Executor) -> None:
    spec = JobSpec("idem", 1, ["sleep", "30"])
    a, b = executor.start(spec), executor.start(spec)
    assert a.pid == b.pid and len(executor.running()) == 1


def test_kill_takes_the_whole_process_group(executor: Executor, tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    rec = executor.start(JobSpec("grp", 1, ["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"]))
    child = int(_wait_for_file(pidfile))
    assert child in executor.job_pids(rec.key)
    done = executor.kill(rec.key, "preempted by a higher priority job", grace_s=2)
    assert (done.state, done.reason) == (JobState.KILLED, "preempted by a higher priority job")
    deadline = time.monotonic() + 10  # SIGKILL is sent; on a busy host it lands a moment later
    while not (_gone(child) and _gone(rec.pid)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _gone(child) and _gone(rec.pid)


def test_sigterm_ignored_escalates_to_sigkill(executor: Executor, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    rec = executor.start(
        JobSpec("stubborn", 1, ["sh", "-c", f"trap '' TERM; echo 1 > {ready}; sleep 60 & wait"])
    )
    _wait_for_file(ready)
    t0 = time.monotonic()
    done = executor.kill(rec.key, "stop asked", grace_s=0.3)
    assert done.state is JobState.KILLED and done.reason == "stop asked"
    assert time.monotonic() - t0 > 0.25  # it waited out the grace, then SIGKILL ended the sleep of 60 s


def test_a_job_handling_sigterm_gets_its_grace_period(executor: Executor, tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint"
    code = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        "    time.sleep(0.2)\n"
        f"    open({str(ckpt)!r}, 'w').write('saved')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        f"open({str(ckpt) + '.ready'!r}, 'w').write('1')\n"
        "time.sleep(60)\n"
    )
    rec = executor.start(JobSpec("graceful", 1, [sys.executable, "-c", code]))
    _wait_for_file(Path(str(ckpt) + ".ready"))
    done = executor.kill(rec.key, "drain", grace_s=5)
    assert ckpt.read_text() == "saved"
    assert (done.state, done.exit_code, done.reason) == (JobState.KILLED, 0, "drain")


def test_leftover_children_are_killed_when_the_job_ends(executor: Executor, tmp_path: Path) -> None:
    pidfile = tmp_path / "bg.pid"
    rec = executor.start(JobSpec("left", 1, ["sh", "-c", f"sleep 60 & echo $! > {pidfile}; exit 0"]))
    done = executor.wait(rec.key, 10)
    assert done.state is JobState.SUCCEEDED
    bg = int(_wait_for_file(pidfile))
    deadline = time.monotonic() + 5
    while not _gone(bg) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _gone(bg)


def test_a_killed_job_ends_only_once_what_it_left_has_exited(executor: Executor, tmp_path: Path) -> None:
    """A process of the job's group that takes a while to die (it frees 1 GiB of touched memory
    first) while its leader dies at once: the end is recorded, and the job leaves `running()`, only
    once that process has exited too. Before, the end came with the leader, and the node started
    the next job on the same device beside a process still holding it."""
    pidfile = tmp_path / "member.pid"
    script = tmp_path / "hold.py"
    script.write_text(
        "import os, time\n"
        "held = b'x' * (1 << 30)\n"
        f"open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(600)\n"
    )
    rec = executor.start(JobSpec("heavy", 1, ["sh", "-c", f"{sys.executable} {script} & wait"]))
    member = int(_wait_for_file(pidfile, 60))
    done = executor.kill(rec.key, "stopped", grace_s=0)
    assert (done.state, done.reason) == (JobState.KILLED, "stopped")
    assert _gone(member), "the job was recorded as ended while a process of its group still ran"
    assert rec.key not in {r.key for r in executor.running()}


def test_killed_by_signal_is_recorded(executor: Executor) -> None:
    rec = executor.start(
        JobSpec("sig", 1, [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    )
    done = executor.wait(rec.key, 10)
    assert done.state is JobState.FAILED and done.reason == "killed by signal 9 (SIGKILL)"
    assert done.exit_code == 137


@pytest.mark.parametrize(("sig", "code"), [("KILL", 137), ("TERM", 143)])
def test_a_signalled_job_exits_128_plus_the_signal(executor: Executor, sig: str, code: int) -> None:
    """Whether the job kills itself or its whole group (taking the wrapper along), the code is 128+N."""
    alone = executor.start(JobSpec(f"self-{sig}", 1, ["sh", "-c", f"kill -{sig} $$"]))
    group = executor.start(JobSpec(f"group-{sig}", 1, ["sh", "-c", f"kill -{sig} 0; sleep 5"]))
    for rec in (executor.wait(alone.key, 10), executor.wait(group.key, 10)):
        assert (rec.state, rec.exit_code) == (JobState.FAILED, code), rec
        assert rec.reason.startswith(f"killed by signal {code - 128} (SIG{sig})"), rec.reason


def test_rlimit_stops_a_memory_hog_with_a_reason(executor: Executor) -> None:
    hog = [sys.executable, "-c", "b = bytearray(600 * 1024 * 1024); print(len(b))"]
    rec = executor.start(JobSpec("hog", 1, hog, memory_mib=200))
    assert "RLIMIT_AS 200 MiB" in rec.limits
    done = executor.wait(rec.key, 20)
    assert done.state is JobState.FAILED
    assert done.reason.startswith("out of memory (RLIMIT_AS 200 MiB)")
    small = executor.start(
        JobSpec("small", 1, [sys.executable, "-c", "b = bytearray(20 * 1024 * 1024)"], memory_mib=200)
    )
    assert executor.wait(small.key, 20).state is JobState.SUCCEEDED


def test_cpu_fallback_pins_to_whole_cores(executor: Executor) -> None:
    rec = executor.start(
        JobSpec(
            "cpu", 1, [sys.executable, "-c", "import os; print(len(os.sched_getaffinity(0)))"], cpu_milli=500
        )
    )
    assert "affinity to 1 CPU" in rec.limits
    done = executor.wait(rec.key, 10)
    assert (Path(done.run_dir) / STDOUT_LOG).read_text().strip() == "1"


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_run_as_another_user(executor: Executor) -> None:
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody'")
    rec = executor.start(JobSpec("asuser", 1, ["sh", "-c", "id -u; echo $HOME"], user="nobody"))
    done = executor.wait(rec.key, 10)
    assert done.state is JobState.SUCCEEDED, done.reason
    assert (Path(done.run_dir) / STDOUT_LOG).read_text().split() == [str(nobody.pw_uid), nobody.pw_dir]


def test_unknown_user_is_a_recorded_failure(executor: Executor) -> None:
    rec = executor.start(JobSpec("nouser", 1, ["true"], user="no-such-user-xyz"))
    assert (rec.state, rec.reason) == (JobState.FAILED, "unknown user: no-such-user-xyz")


def test_cgroup_v2_limits_when_writable(tmp_path: Path) -> None:
    base = Path(f"/sys/fs/cgroup/computepool-test-{os.getpid()}")
    cg = CgroupV2(base)
    ok, why = cg.usable()
    if not ok:
        pytest.skip(f"cgroup v2 not writable here: {why}")
    ex = Executor(tmp_path / "agent", cgroup_base=base, kill_grace_s=1)
    try:
        rec = ex.start(
            JobSpec(
                "cg",
                1,
                [sys.executable, "-c", "b = bytearray(600 * 1024 * 1024)"],
                cpu_milli=500,
                memory_mib=128,
            )
        )
        assert rec.cgroup and "cgroup v2" in rec.limits
        done = ex.wait(rec.key, 20)
        assert done.state is JobState.FAILED
        assert "out of memory" in done.reason
    finally:
        cgroups.remove([p for p in (ex.cgroup_dir, base) if p is not None])


def test_a_job_that_ends_wakes_its_watcher_at_once(tmp_path: Path) -> None:
    """An end is seen when it happens (a pidfd per leader), not at the loop's next pass: for a job
    this executor started and for one it re-adopted after a restart."""
    data = tmp_path / "agent"
    first = Executor(data, cgroup_base=None)
    held = first.start(JobSpec("held", 1, ["sh", "-c", "while [ ! -e go ]; do sleep 0.05; done"]))
    first.state.close()
    woke = threading.Event()
    ex = Executor(data, cgroup_base=None, on_exit=woke.set)
    try:
        assert [r.key for r in ex.adopt().adopted] == [held.key]
        quick = ex.start(JobSpec("quick", 1, ["true"]))
        assert ex.exits is not None and woke.wait(10), "the end of `true` woke nobody"
        assert [(r.key, r.state) for r in ex.poll()] == [(quick.key, JobState.SUCCEEDED)]
        assert ex.exits.watching() == {held.key}
        woke.clear()
        assert not woke.wait(0.2)  # the adopted job runs on: no wake
        (Path(held.run_dir) / "go").touch()
        assert woke.wait(10), "the end of the adopted job woke nobody"
        assert [(r.key, r.state) for r in ex.poll()] == [(held.key, JobState.SUCCEEDED)]
        assert ex.exits.watching() == set()
    finally:
        for rec in ex.running():
            ex.kill(rec.key, "test teardown", grace_s=0)
        ex.close()
        ex.state.close()


def test_what_left_the_jobs_group_dies_with_it_through_its_cgroup(tmp_path: Path) -> None:
    """A child that left the job's process group (setsid) is still in its cgroup: killed at the
    job's end through the cgroup (cgroup.kill on v2, each member on v1), found without a scan."""
    base = Path(f"/sys/fs/cgroup/computepool-test-{uuid.uuid4().hex[:8]}")
    ex = Executor(tmp_path / "agent", cgroup_base=base, kill_grace_s=1)
    if ex.cgroups is None or ex.cgroup_dir is None or not ex.cgroups.usable()[0]:
        pytest.skip("no writable cgroup hierarchy here")
    pidfile = tmp_path / "escaped.pid"
    try:
        rec = ex.start(
            JobSpec("esc", 1, ["sh", "-c", f"setsid sleep 60 & echo $! > {pidfile}; exit 0"], memory_mib=256)
        )
        assert rec.cgroup, rec.limits
        assert ex.wait(rec.key, 20).state is JobState.SUCCEEDED
        escaped = int(_wait_for_file(pidfile))
        deadline = time.monotonic() + 10
        while not _gone(escaped) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _gone(escaped)
        assert not Path(rec.cgroup).exists()  # emptied, so removed with the job
    finally:
        for rec in ex.running():
            ex.kill(rec.key, "test teardown", grace_s=0)
        ex.state.close()
        if isinstance(ex.cgroups, CgroupV1):
            for c in ex.cgroups.controllers:
                top = ex.cgroups.root / c / base.name
                cgroups.remove([top / ex.cgroup_dir.name, top])
        else:
            cgroups.remove([ex.cgroup_dir, base])
