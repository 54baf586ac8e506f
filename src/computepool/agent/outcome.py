"""Whether a job's processes are still its own, what it left behind, and how it ended.

A job's leader is known by pid *and* start time, so a reused pid is never signalled or taken for
the job; its exit status comes from the file its wrapper writes, so an agent that restarted can
still tell how a job ended while it was away.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from computepool.agent import cgroups
from computepool.agent.jobnet import SANDBOX_FAILED
from computepool.agent.jobspec import EXIT_FILE, STDERR_LOG
from computepool.agent.localstate import JobRecord

_OOM_MARKERS = ("MemoryError", "std::bad_alloc", "Cannot allocate memory", "out of memory")


def alive(rec: JobRecord, zombie_ok: bool = False) -> bool:
    """Is the job's leader still this job's process (same pid and start time)?"""
    try:
        p = psutil.Process(rec.pid)
        if abs(p.create_time() - rec.create_time) >= 0.05:
            return False
        return zombie_ok or p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def child_exited(popen: subprocess.Popen[bytes]) -> bool:
    """Whether the child ended, leaving it unreaped (a zombie holds its pid and group id)."""
    if popen.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped by someone else: Popen.wait() says so
        return True


def kill_leftovers(rec: JobRecord) -> None:
    """SIGKILL to whatever the job left: its process group by number while that number provably
    stays the job's (group_is_ours), and every process of its cgroup. A job without a cgroup whose
    group number is not provably its own: only the group's members checked through a pidfd to be
    the job's (signal_members). Never a bare group number whose leader may be gone: that number may
    be another tenant's group by now."""
    paths = _cgroup_paths(rec)
    if group_is_ours(rec):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rec.pgid, signal.SIGKILL)
    elif not paths:
        signal_members(rec, signal.SIGKILL)
    if paths:
        kill_cgroup(paths)


def still_dying(rec: JobRecord, reaped_at: float | None) -> bool:
    """Whether a process the job left is still on its way out after its leader was reaped (at
    `reaped_at`; None for a job adopted after a restart, whose leader someone else reaped): a member
    of its cgroup, or of its process group. Each one found gets SIGKILL again. A killed process keeps
    its devices until it has exited, and that can take a while: a PID namespace's init does not exit
    before every process of its namespace has, and under load the kernel takes its time. The node
    hands a job's devices to the next job only once this is false.

    The group is looked for by number only when the kernel says the number is in use (one cheap
    `killpg(n, 0)`), so a job whose processes all died with it costs no scan. The group's number
    was the job's until its leader was reaped: a member that existed before then is the job's. For
    an adopted job, only members checked as `signal_members` checks them (its user, not older)."""
    paths = _cgroup_paths(rec)
    members = set().union(*(cgroups.pids(p) for p in paths)) if paths else set()
    for pid in members:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)  # still in the job's cgroup: the job's, whatever its number
    if members:
        return True
    if rec.pgid <= 1:
        return False
    try:
        os.killpg(rec.pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # in use by a process we may not signal: look at its members
    uid = _job_uid(rec) if reaped_at is None else None
    if reaped_at is None and uid is None:
        return False  # whose the group is cannot be told: as before, nothing is waited for
    found = False
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) != rec.pgid:
                continue
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if reaped_at is not None:
                # create_time counts from a boot time rounded to the second: a second's margin errs
                # on the side of waiting
                ours = p.create_time() <= reaped_at + 1.0
            else:
                ours = uid is not None and _member(pid, rec, uid)
            if ours:
                found = True
                p.send_signal(signal.SIGKILL)  # psutil refuses if the pid was taken meanwhile
        except (psutil.Error, OSError):
            continue
    return found


def signal_job(rec: JobRecord, sig: signal.Signals) -> None:
    """`sig` to the job's processes: its group by number while that is provably the job's, else
    each member of its cgroup (or of its group, without one) checked through a pidfd first."""
    if group_is_ours(rec):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rec.pgid, sig)
        return
    paths = _cgroup_paths(rec)
    if not paths:
        signal_members(rec, sig)
        return
    for pid in set().union(*(cgroups.pids(p) for p in paths)):
        _signal_checked(pid, sig, lambda pid: any(pid in cgroups.pids(p) for p in paths))


def group_is_ours(rec: JobRecord) -> bool:
    """Whether the job's process group number is provably the job's until the agent reaps its
    leader: the leader (its pid is the group's number) is still the job's process (same start
    time), alive or an unreaped zombie, and the agent's own child, so no one else can reap it and
    free the number. A job adopted after a restart is not: its leader's new parent may reap it at
    any moment, and the number then goes to the next process that asks."""
    try:
        leader = psutil.Process(rec.pgid)
        return (
            rec.pgid == rec.pid
            and abs(leader.create_time() - rec.create_time) < 0.05
            and leader.ppid() == os.getpid()
        )
    except psutil.Error:
        return False


def signal_members(rec: JobRecord, sig: signal.Signals) -> None:
    """`sig` to each process of the job's group that is checked, through a pidfd held meanwhile, to
    be the job's: in the group, of the job's user, started no earlier than the job. Nothing where
    the job's user is not known or is root (other tenants' root-run steps could match)."""
    uid = _job_uid(rec)
    if uid is None or rec.pgid <= 1:
        return
    for pid in psutil.pids():
        _signal_checked(pid, sig, lambda pid: _member(pid, rec, uid))


def _member(pid: int, rec: JobRecord, uid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return (
            os.getpgid(pid) == rec.pgid and p.uids().real == uid and p.create_time() >= rec.create_time - 0.05
        )
    except (psutil.Error, OSError):
        return False


def _signal_checked(pid: int, sig: signal.Signals, check: Callable[[int], bool]) -> None:
    """`sig` to `pid` if `check` says it is the job's. The pidfd is opened before the check: if the
    process ends (and its pid is taken) after it, the signal goes nowhere (ESRCH), never to the new
    process."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return
    try:
        if check(pid):
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(pidfd, sig)
    finally:
        os.close(pidfd)


def _job_uid(rec: JobRecord) -> int | None:
    name = rec.extra.get("user")
    if name:
        try:
            uid = pwd.getpwnam(name).pw_uid
        except KeyError:
            return None
    else:
        uid = os.geteuid()  # an agent that is not root runs every job as itself
    return uid if uid != 0 else None


def _cgroup_paths(rec: JobRecord) -> list[Path]:
    if not rec.cgroup:
        return []
    return [Path(p) for p in (rec.extra.get("cgroup_paths") or rec.cgroup).splitlines() if p]


def kill_cgroup(paths: list[Path], wait_s: float = 2.0) -> None:
    """SIGKILL to every process of a job's cgroup: `cgroup.kill` (v2, Linux 5.14+) takes forks in
    flight too; elsewhere (v1, older kernels) each listed member, again while any is listed. Waits
    (at most `wait_s`) until the cgroup is empty: a dying process still holds it, and the cgroup is
    removed right after."""
    by_kernel = False
    for path in paths:
        with contextlib.suppress(OSError):
            (path / "cgroup.kill").write_text("1")
            by_kernel = True
            break
    deadline = time.monotonic() + wait_s
    while True:
        members = set().union(*(cgroups.pids(p) for p in paths)) if paths else set()
        if not members or time.monotonic() >= deadline:
            return
        if not by_kernel:  # a member may fork while it is being killed: those are listed next time
            for pid in members:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)


def shell_status(rc: int | None) -> int | None:
    """A status as a shell reports it: a process killed by signal N is 128+N. Popen says -N when
    the wrapper itself was killed (a job that signals its whole group takes the wrapper along);
    the wrapper says 128+N for a job killed alone, so both read the same everywhere."""
    return 128 - rc if rc is not None and rc < 0 else rc


def explain_exit(rec: JobRecord, rc: int) -> str:
    """Why a job that ended by itself with status `rc` failed, in the words its owner reads."""
    sig = -rc if rc < 0 else rc - 128 if 128 < rc < 128 + 65 else 0
    if sig:
        try:
            name = f" ({signal.Signals(sig).name})"
        except ValueError:
            name = ""
        return f"killed by signal {sig}{name}"
    if rec.extra.get("container") and rc in (125, 126, 127):
        from computepool.agent.container import Podman  # noqa: PLC0415 - optional until used

        return f"exit code {rc}: {Podman.explain(rc)}"
    if rc == 127:
        return f"command not found: {rec.command[0]}"
    if rc == 126 and (step := _sandbox_failure(Path(rec.run_dir))):
        return f"exit code 126: {step}"
    if rc == 126 and rec.extra.get("user"):
        return f"exit code 126: {rec.command[0]} is not executable by user {rec.extra['user']}"
    if "RLIMIT_AS" in rec.limits and _stderr_says_oom(Path(rec.run_dir)):
        return f"out of memory (RLIMIT_AS {rec.memory_mib} MiB): exit code {rc}"
    return f"exit code {rc}"


def read_exit(run_dir: Path) -> int | None:
    """The status the job's wrapper wrote on exit; None if it never did (killed, or still running)."""
    try:
        return int((run_dir / EXIT_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def _stderr_tail(run_dir: Path) -> str:
    try:
        with open(run_dir / STDERR_LOG, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _stderr_says_oom(run_dir: Path) -> bool:
    tail = _stderr_tail(run_dir)
    return any(m in tail for m in _OOM_MARKERS)


def _sandbox_failure(run_dir: Path) -> str:
    """The launcher's own line when it could not isolate the job (the sandbox's init, jobnet): its
    exit 126 is not the command's. The job could print the same line, misleading only its own."""
    lines = [ln for ln in _stderr_tail(run_dir).splitlines() if ln.startswith(SANDBOX_FAILED)]
    return lines[-1].removeprefix("cpool: ") if lines else ""
