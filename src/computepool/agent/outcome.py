"""Whether a job's processes are still its own, what it left behind, and how it ended.

A job's leader is known by pid *and* start time, so a reused pid is never signalled or taken for
the job; its exit status comes from the file its wrapper writes, so an agent that restarted can
still tell how a job ended while it was away.
"""

from __future__ import annotations

import contextlib
import os
import signal
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


def kill_leftovers(rec: JobRecord) -> None:
    """Processes the job left in its group: only those born after the job (no pgid reuse)."""
    victims: list[psutil.Process] = []
    for p in psutil.process_iter(["pid", "create_time"]):
        try:
            if os.getpgid(p.pid) == rec.pgid and p.info["create_time"] >= rec.create_time - 0.05:
                victims.append(p)
        except (OSError, psutil.Error):
            continue
    for p in victims:
        with contextlib.suppress(psutil.Error):
            p.kill()
    if rec.cgroup:
        for pid in cgroups.pids(Path(rec.cgroup)):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


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
