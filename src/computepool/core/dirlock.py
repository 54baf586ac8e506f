"""One process per data dir: `cpool server`, `cpool agent` and `cpool up` hold theirs locked.

Two servers on one SQLite file, or two agents on one set of job records, would each take the
other's jobs and files for their own. So each holds an exclusive `flock` on `DATA_DIR/cpool.lock`
for as long as it runs (the kernel drops it when the process ends, however it ends), and a
second one fails at once, naming the holder from the lines the holders wrote into the file.

`cpool up` locks its data dir and hands the lock to the control plane it starts there (an
inherited descriptor, named by `LOCK_FD_ENV`): the lock is one open file shared by both, so it
stays held while either runs, and no one else can take it through the variable.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

LOCK_FILE = "cpool.lock"
LOCK_FD_ENV = "CPOOL_DATA_DIR_LOCK_FD"


class DataDirBusy(Exception):
    """The data dir is held by another process; the message names it, as one line."""


@dataclass(frozen=True)
class DataDirLock:
    """A held lock: the open descriptor keeps it until `release` or the end of the process."""

    path: Path
    fd: int

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def lock_data_dir(data_dir: Path, command: str) -> DataDirLock:
    """Lock `data_dir` (made 0700 if missing) for this process, `command` (e.g. "cpool agent") being
    what a second one is told holds it. Raises DataDirBusy, or OSError when the dir is unusable."""
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = data_dir / LOCK_FILE
    inherited = _inherited(path)
    if inherited is not None:
        _record(inherited, command, truncate=False)
        return DataDirLock(path, inherited)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        for _ in range(20):  # the holder may be between taking the lock and writing its line
            if path.stat().st_size:
                break
            time.sleep(0.05)
        raise DataDirBusy(
            f"data dir {data_dir} is in use by {holders(path)}; one cpool server, agent or `cpool up` "
            "per data dir: stop that one or give another --data-dir"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    _record(fd, command, truncate=True)
    return DataDirLock(path, fd)


def _inherited(path: Path) -> int | None:
    """The descriptor `cpool up` passed down, if it is an open file on this very lock file whose lock
    this process now holds (it shares the parent's, the same open file); None otherwise."""
    text = os.environ.pop(LOCK_FD_ENV, "")
    if not text.isdigit():
        return None
    fd = int(text)
    try:
        mine, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
        if (mine.st_dev, mine.st_ino) != (there.st_dev, there.st_ino):
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no-op on the shared lock; fails on any other
    except OSError:
        return None
    os.set_inheritable(fd, False)  # the jobs and helpers this process starts never hold it
    return fd


def _record(fd: int, command: str, *, truncate: bool) -> None:
    """Add this process to the holders written in the file (the first holder starts it afresh)."""
    line = json.dumps({"pid": os.getpid(), "command": command}) + "\n"
    if truncate:
        os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_END)
    os.write(fd, line.encode())


def holders(path: Path) -> str:
    """Who holds the lock, in words: the recorded holders still alive ("pid 12 (cpool up)")."""
    recorded: list[tuple[int, str]] = []
    with contextlib.suppress(OSError):
        for raw in path.read_text().splitlines():
            with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
                item = json.loads(raw)
                recorded.append((int(item["pid"]), str(item["command"])))
    live = [f"pid {pid} ({cmd})" for pid, cmd in recorded if psutil.pid_exists(pid)]
    if live:
        return ", ".join(live)
    return "another process" + (f" (started by pid {recorded[0][0]})" if recorded else "")
