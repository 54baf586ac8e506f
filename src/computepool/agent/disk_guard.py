"""The node's disk, kept usable for every tenant and for the agent itself.

Two things fill an agent's data dir: the run dirs of finished attempts (their logs and work files,
kept for `cpool cp` and `--output` after the end) and a running job that writes without end. As the
kubelet does with dead containers and under disk pressure:

- A finished attempt's run dir is removed once the control plane has acknowledged its end and
  `keep_s` has passed (default an hour), oldest first; the dirs are walked every five minutes
  (a look at the free space alone every ten seconds), so an idle agent's cost does not follow
  how many attempts it keeps. While the disk is low, every such dir older
  than `MIN_KEEP_S` goes, oldest first, until it is not.
- While the disk stays low with nothing finished left to remove, the running job whose own files
  take the most is stopped, its reason naming the sizes; its dir goes once its end is acknowledged.

The disk is low when less than `min(min_free_bytes, min_free_share × its size)` is free to
unprivileged writers (`statvfs.f_bavail`). Nothing is removed that the agent may still use: a
running attempt, one being prepared, or an end not yet acknowledged (`protected`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("computepool.agent")

MIB = 1 << 20
GUARD_EVERY_S = 10.0  # a look at the free space (one statvfs)
SWEEP_EVERY_S = 300.0  # a walk over the finished attempts' dirs when the disk is not low
KEEP_S = 3600.0  # a finished attempt's files stay this long after its end
MIN_KEEP_S = 60.0  # even on a full disk: `--output` fetches right after the end
MIN_FREE_BYTES = 2 << 30
MIN_FREE_SHARE = 0.05


@dataclass(frozen=True)
class DiskJob:
    """A running job, the directory its files are written under and, where its tenant has one, the
    tenant's cache (CPOOL_CACHE_DIR, kept between jobs), of which what changed since the job's start
    (`started`, Unix seconds) counts as the job's: a job filling the disk there is its tenant's."""

    key: str
    path: Path
    cache: Path | None = None
    started: float = 0.0


def free_space(path: Path) -> tuple[int, int]:
    """(bytes free to unprivileged writers, bytes in all) of the filesystem holding `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def tree_bytes(path: Path, since: float | None = None, dev: int | None = None) -> int:
    """Disk blocks under `path`, not following links nor crossing into other filesystems; with
    `since`, of the entries changed since then only (ctime, which no owner can set back); with `dev`,
    0 unless `path` is on that filesystem."""
    try:
        here = os.lstat(path).st_dev
    except OSError:
        return 0
    if dev is not None and here != dev:
        return 0
    dev = here
    total, todo = 0, [path]
    while todo:
        d = todo.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_dev != dev:
                continue
            if since is None or st.st_ctime >= since:
                total += st.st_blocks * 512
            if stat.S_ISDIR(st.st_mode):
                todo.append(Path(e.path))
    return total


def _mib(n: int) -> str:
    return f"{n / MIB:.0f} MiB"


class DiskGuard:
    """Removes finished attempts' run dirs and stops a job that fills the disk (see the module).

    `runs` is the agent's `runs/<allocation>/<attempt>` tree; `key(allocation, attempt)` names an
    attempt as LocalState does; `protected()` lists the attempts not to touch (None: touch none);
    `jobs()` the
    running ones with their dirs; `stop(key, reason)` stops one."""

    def __init__(
        self,
        runs: Path,
        key: Callable[[str, int], str],
        protected: Callable[[], set[str] | None],
        jobs: Callable[[], Iterable[DiskJob]],
        stop: Callable[[str, str], None],
        *,
        keep_s: float = KEEP_S,
        min_free_bytes: int = MIN_FREE_BYTES,
        min_free_share: float = MIN_FREE_SHARE,
        every_s: float = GUARD_EVERY_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.runs, self.key, self.protected, self.jobs, self.stop_job = runs, key, protected, jobs, stop
        self.keep_s, self.min_free_bytes, self.min_free_share = keep_s, min_free_bytes, min_free_share
        self.every_s, self.clock = every_s, clock
        self._swept: float | None = None  # when the last walk over the finished dirs was (clock)
        self._stopped: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def low(self) -> tuple[bool, int, int]:
        """(whether the disk is low, bytes free, bytes in all)."""
        try:
            free, total = free_space(self.runs if self.runs.exists() else self.runs.parent)
        except OSError:
            return False, 0, 0
        return free < min(self.min_free_bytes, self.min_free_share * total), free, total

    def finished(self) -> list[tuple[float, Path]]:
        """(ended at, run dir) of the attempts no one uses any more, oldest first."""
        keep = self.protected()
        if keep is None:  # the agent does not know yet what it runs: nothing goes
            return []
        out = []
        try:
            allocs = list(self.runs.iterdir())
        except OSError:
            return []
        for a in allocs:
            try:
                attempts = list(a.iterdir())
            except OSError:
                continue
            for d in attempts:
                if not d.name.isdigit() or self.key(a.name, int(d.name)) in keep:
                    continue
                try:  # the newest of the dir and its direct entries (the exit file comes last)
                    times = [e.stat(follow_symlinks=False).st_mtime for e in os.scandir(d)]
                    ended = max([d.lstat().st_mtime, *times])
                except OSError:
                    continue
                out.append((ended, d))
        return sorted(out)

    def _remove(self, d: Path, why: str) -> None:
        shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            d.parent.rmdir()  # the allocation's dir, once its last attempt is gone
        log.info("removed %s (%s)", d, why)

    def check_once(self) -> list[str]:
        """One pass; what it did, in words (for logs and tests)."""
        done: list[str] = []
        now = self.clock()
        low, free, total = self.low()
        if not low and self._swept is not None and now - self._swept < SWEEP_EVERY_S:
            return done  # the walk costs as many dirs as the node keeps: not every pass
        self._swept = now
        for ended, d in self.finished():
            age = now - ended
            if age >= self.keep_s:
                self._remove(d, f"ended {age:.0f} s ago")
                done.append(f"removed {d}")
            elif low and age >= MIN_KEEP_S:
                self._remove(d, f"the disk is low: {_mib(free)} free")
                done.append(f"removed {d}")
                low, free, total = self.low()
        if not low:
            return done
        running = [j for j in self.jobs() if j.key not in self._stopped]
        if not running:
            return done
        sizes = sorted(((self._bytes_of(j), j.key) for j in running), reverse=True)
        size, key = sizes[0]
        if size < MIB:  # not the jobs' doing: nothing of theirs to stop for it
            return done
        reason = (
            f"the node's disk is nearly full ({_mib(free)} free of {_mib(total)}); this job's files "
            f"(with what it wrote to its tenant's cache) took {_mib(size)}, the most of any job's on the node"
        )
        log.warning("stopping %s: %s", key, reason)
        self._stopped.add(key)
        self.stop_job(key, reason)
        done.append(f"stopped {key}")
        return done

    def _bytes_of(self, job: DiskJob) -> int:
        """The job's files, and what changed in its tenant's cache since its start where that cache
        shares the disk (a tenant's writes outside its job's dir fill it as well)."""
        own = tree_bytes(job.path)
        if job.cache is None:
            return own
        try:
            dev = os.stat(self.runs if self.runs.exists() else self.runs.parent).st_dev
        except OSError:
            return own
        return own + tree_bytes(job.cache, since=job.started, dev=dev)

    # ---- the thread ------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="disk-guard", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.check_once()
            except Exception:  # never let a pass end the guard
                log.exception("disk guard pass failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
