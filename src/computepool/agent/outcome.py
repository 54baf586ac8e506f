"""Whether a job's processes are still its own, what it left behind, and how it ended.

A job's leader is known by pid *and* start time, so a reused pid is never signalled or taken for
the job; its exit status comes from the file its wrapper writes, so an agent that restarted can
still tell how a job ended while it was away.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

from computepool.agent import cgroups
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
    """SIGKILL to whatever the job left: its process group while that group id is still the job's,
    and every process of its cgroup. Only the job's own group and cgroup are looked at, never the
    host's process table: this runs at every job's end."""
    if group_is_ours(rec):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rec.pgid, signal.SIGKILL)
    if rec.cgroup:
        kill_cgroup([Path(p) for p in (rec.extra.get("cgroup_paths") or rec.cgroup).splitlines()])


def group_is_ours(rec: JobRecord) -> bool:
    """Whether the job's process group id still names the job's group. The leader's pid is the group
    id: while the leader lives, or is an unreaped zombie (the executor reaps only after this), no
    other group can have it. Once the pid is free again, a group that still has members keeps the
    number from being reused, so the members are the job's; a pid that now names another process
    (another start time) means the number was reused, and the group is left alone."""
    try:
        leader = psutil.Process(rec.pgid)
        return rec.pgid == rec.pid and abs(leader.create_time() - rec.create_time) < 0.05
    except psutil.NoSuchProcess:
        return rec.pgid > 1
    except psutil.Error:
        return False


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


def _stderr_says_oom(run_dir: Path) -> bool:
    try:
        with open(run_dir / STDERR_LOG, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            tail = f.read().decode(errors="replace")
    except OSError:
        return False
    return any(m in tail for m in _OOM_MARKERS)
