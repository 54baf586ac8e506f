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
  Unless files no running job answers for take more (a run dir kept a while after its job ended
  or was stopped, what a tenant's cache got lately from jobs gone): stopping another job would
  free none of them, so none is stopped for them (the agent's log says so).

A container's writable layer lives in podman's storage, which may be a disk of its own: while that
disk is low, the running container whose layer there takes the most is stopped the same way. So
do the tenants' caches (`cache_root`, the node's root disk by default, while the data dir may be a
big disk of its own): while their disk is low, the running job that wrote the most to its
tenant's cache since it started is stopped (a job filled that disk, and the node's own files on
it, through its cache, unseen).

The disk is low when less than `min(min_free_bytes, min_free_share × its size)` is free to
unprivileged writers (`statvfs.f_bavail`), or fewer than `min(min_free_inodes, min_free_share × its
inodes)` inodes (`f_favail`): then the job that made the most files is the one stopped. Nothing
is removed that the agent may still use: a running attempt, one being prepared, or an end not yet
acknowledged (`protected`).
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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from computepool.agent.executor import Executor

log = logging.getLogger("computepool.agent")

MIB = 1 << 20
GUARD_EVERY_S = 10.0  # a look at the free space (one statvfs)
SWEEP_EVERY_S = 300.0  # a walk over the finished attempts' dirs when the disk is not low
KEEP_S = 3600.0  # a finished attempt's files stay this long after its end
MIN_KEEP_S = 60.0  # even on a full disk: `--output` fetches right after the end
MIN_FREE_BYTES = 2 << 30
MIN_FREE_SHARE = 0.05
MIN_FREE_INODES = 100_000


@dataclass(frozen=True)
class DiskJob:
    """A running job, the directory its files are written under and, where its tenant has one, the
    tenant's cache (CPOOL_CACHE_DIR, kept between jobs), of which what changed since the job's start
    (`started`, Unix seconds) counts as the job's: a job filling the disk there is its tenant's."""

    key: str
    path: Path
    cache: Path | None = None
    started: float = 0.0
    layer: Path | None = None  # a container's writable layer: all of it is the job's


def running_jobs(executor: Executor) -> list[DiskJob]:
    """The executor's running jobs (but those being stopped) as the guard weighs them."""
    launcher = executor.launcher
    out: list[DiskJob] = []
    for r in executor.running():
        if r.stop_reason:
            continue
        key = r.extra.get("container")
        layer = launcher.container_engine().writable_layer(key) if key else None
        out.append(
            DiskJob(r.key, Path(r.run_dir), launcher.cache_of(r.extra.get("tenant", "")), r.started_at, layer)
        )
    return out


def free_space(path: Path) -> tuple[int, int]:
    """(bytes free to unprivileged writers, bytes in all) of the filesystem holding `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def free_inodes(path: Path) -> tuple[int, int]:
    """(inodes free to unprivileged writers, inodes in all; 0 where the filesystem has no fixed
    count, as btrfs) of the filesystem holding `path`."""
    st = os.statvfs(path)
    return st.f_favail, st.f_files


def tree_bytes(path: Path, since: float | None = None, dev: int | None = None) -> int:
    """Disk blocks under `path`, not following links nor crossing into other filesystems; with
    `since`, of the entries changed since then only (ctime, which no owner can set back); with `dev`,
    0 unless `path` is on that filesystem."""
    return tree_usage(path, since, dev)[0]


def tree_usage(path: Path, since: float | None = None, dev: int | None = None) -> tuple[int, int]:
    """(bytes, entries) under `path`, as `tree_bytes` counts them."""
    try:
        here = os.lstat(path).st_dev
    except OSError:
        return 0, 0
    if dev is not None and here != dev:
        return 0, 0
    dev = here
    total, count, todo = 0, 0, [path]
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
                count += 1
            if stat.S_ISDIR(st.st_mode):
                todo.append(Path(e.path))
    return total, count


def _subdirs(path: Path) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


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
        min_free_inodes: int = MIN_FREE_INODES,
        every_s: float = GUARD_EVERY_S,
        clock: Callable[[], float] = time.time,
        cache_root: Path | None = None,
    ) -> None:
        """`cache_root`: where the tenants' caches are (one dir each), when on a disk of the node."""
        self.runs, self.key, self.protected, self.jobs, self.stop_job = runs, key, protected, jobs, stop
        self.cache_root = cache_root
        self.keep_s, self.min_free_bytes, self.min_free_share = keep_s, min_free_bytes, min_free_share
        self.min_free_inodes = min_free_inodes
        self.every_s, self.clock = every_s, clock
        self._swept: float | None = None  # when the last walk over the finished dirs was (clock)
        self._stopped: set[str] = set()
        self._stopped_layers: set[Path] = set()  # the writable layers of containers stopped for space
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _disk(self) -> Path:
        return self.runs if self.runs.exists() else self.runs.parent

    def low(self, on: Path | None = None) -> tuple[bool, int, int]:
        """(whether the disk (the data dir's, or `on`'s) is low, bytes free, bytes in all)."""
        try:
            free, total = free_space(on or self._disk())
        except OSError:
            return False, 0, 0
        return free < min(self.min_free_bytes, self.min_free_share * total), free, total

    def inodes_low(self, on: Path | None = None) -> tuple[bool, int, int]:
        """(whether the disk is short of inodes, inodes free, inodes in all): a job making empty
        files without end leaves no file to create for anyone while its bytes stay few."""
        try:
            free, total = free_inodes(on or self._disk())
        except OSError:
            return False, 0, 0
        return total > 0 and free < min(self.min_free_inodes, self.min_free_share * total), free, total

    def _pressure(self, on: Path | None = None) -> tuple[bool, bool, str]:
        """(bytes low, inodes low, what is free in words)."""
        low, free, total = self.low(on)
        short, ifree, itotal = self.inodes_low(on)
        if short and not low:
            return low, short, f"{ifree} inodes free of {itotal}"
        return low, short, f"{_mib(free)} free of {_mib(total)}"

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
        return self._check_data_disk() + self._check_layer_disks() + self._check_cache_disk()

    def _check_cache_disk(self) -> list[str]:
        """The tenants' caches on a disk other than the data dir's: while it is low, the running job
        that wrote the most to its tenant's cache since it started is stopped, unless writes no
        running job answers for take more there."""
        if self.cache_root is None:
            return []
        try:
            home, dev = os.stat(self._disk()).st_dev, os.stat(self.cache_root).st_dev
        except OSError:
            return []
        if dev == home:
            return []  # counted with the data dir's disk (`_usage_of`)
        low, short, free = self._pressure(self.cache_root)
        if not (low or short):
            return []
        running = [j for j in self.jobs() if j.key not in self._stopped]
        which = 0 if low else 1
        cached = [j for j in running if j.cache is not None]
        usage = {j.key: tree_usage(j.cache, since=j.started, dev=dev)[which] for j in cached if j.cache}
        size, key = max(((u, k) for k, u in usage.items()), default=(0, ""))
        if size < (MIB if low else 1000):
            return []
        orphan = max((u[which] for u in self._unclaimed_caches(running, dev).values()), default=0)
        if orphan > size:  # left by jobs that no longer run: stopping another frees nothing of it
            return []
        what = "nearly full" if low else "out of inodes"
        took = _mib(size) if low else f"{size} files"
        reason = (
            f"the disk of the tenants' caches is {what} ({free}); what this job wrote to its tenant's "
            f"cache took {took}, the most of any job's there"
        )
        log.warning("stopping %s: %s", key, reason)
        self._stopped.add(key)
        self.stop_job(key, reason)
        return [f"stopped {key}"]

    def _check_layer_disks(self) -> list[str]:
        """Containers' writable layers on disks other than the data dir's: while one is low, the
        container whose layer there takes the most is stopped."""
        try:
            home = os.stat(self._disk()).st_dev
        except OSError:
            return []
        by_dev: dict[int, list[DiskJob]] = {}
        for j in self.jobs():
            if j.layer is None or j.key in self._stopped:
                continue
            with contextlib.suppress(OSError):
                dev = os.stat(j.layer).st_dev
                if dev != home:
                    by_dev.setdefault(dev, []).append(j)
        done: list[str] = []
        for jobs in by_dev.values():
            low, short, free = self._pressure(jobs[0].layer)
            if not (low or short):
                continue
            which = 0 if low else 1
            dev = os.stat(jobs[0].layer or "/").st_dev
            usage = {j.key: tree_usage(j.layer, dev=dev) for j in jobs if j.layer}
            size, key = max((u[which], k) for k, u in usage.items())
            if size < (MIB if low else 1000):
                continue
            # the layer of one stopped before stays until its container is removed: no other
            # container is stopped for it
            left = [tree_usage(p, dev=dev)[which] for p in self._stopped_layers if p.exists()]
            if max(left, default=0) > size:
                continue
            what = "nearly full" if low else "out of inodes"
            took = _mib(size) if low else f"{size} files"
            reason = (
                f"the node's container storage is {what} ({free}); this job's container's own files "
                f"took {took}, the most of any job's there"
            )
            log.warning("stopping %s: %s", key, reason)
            self._stopped.add(key)
            self._stopped_layers = {p for p in self._stopped_layers if p.exists()}
            self._stopped_layers |= {j.layer for j in jobs if j.key == key and j.layer is not None}
            self.stop_job(key, reason)
            done.append(f"stopped {key}")
        return done

    def _check_data_disk(self) -> list[str]:
        done: list[str] = []
        now = self.clock()
        low, short, free = self._pressure()
        if not (low or short) and self._swept is not None and now - self._swept < SWEEP_EVERY_S:
            return done  # the walk costs as many dirs as the node keeps: not every pass
        self._swept = now
        for ended, d in self.finished():
            age = now - ended
            if age >= self.keep_s:
                self._remove(d, f"ended {age:.0f} s ago")
                done.append(f"removed {d}")
            elif (low or short) and age >= MIN_KEEP_S:
                self._remove(d, f"the disk is low: {free}")
                done.append(f"removed {d}")
                low, short, free = self._pressure()
        if not (low or short):
            return done
        running = [j for j in self.jobs() if j.key not in self._stopped]
        if not running:
            return done
        usage = {j.key: self._usage_of(j) for j in running}
        unclaimed = self._unclaimed(running)
        which = 0 if low else 1  # bytes, else files (inodes)
        size, key = max((u[which], k) for k, u in usage.items())
        took = _mib(size) if low else f"{size} files"
        if size < (MIB if low else 1000):  # not the jobs' doing: nothing of theirs to stop for it
            return done
        orphan, cache = max(((u[which], str(c)) for c, u in unclaimed.items()), default=(0, ""))
        if orphan > size:  # filled by no running job: stopping another would free nothing of it
            log.warning(
                "the node's disk is low (%s): %s of it is in %s, left by no job that runs (more "
                "than any running job wrote); no job is stopped for it",
                free, _mib(orphan) if low else f"{orphan} files", cache,
            )  # fmt: skip
            return done
        what = "nearly full" if low else "out of inodes"
        reason = (
            f"the node's disk is {what} ({free}); this job's files "
            f"(with what it wrote to its tenant's cache and its container's own files) took {took}, the "
            "most of any job's on the node"
        )
        log.warning("stopping %s: %s", key, reason)
        self._stopped.add(key)
        self.stop_job(key, reason)
        done.append(f"stopped {key}")
        return done

    def _unclaimed(self, running: list[DiskJob]) -> dict[Path, tuple[int, int]]:
        """(bytes, files) on this disk that no running job answers for, where a job that ended, or
        was stopped, left them: each run dir kept that is no running job's (its end not yet
        acknowledged, or younger than MIN_KEEP_S), and per tenant cache what was written to it in
        the last `keep_s` before the first of the running jobs that use it started (the whole
        window where none does)."""
        out: dict[Path, tuple[int, int]] = {}
        mine = {j.path for j in running}
        for attempts in _subdirs(self.runs):
            for d in _subdirs(attempts):
                if d not in mine:
                    out[d] = tree_usage(d)
        if self.cache_root is None:
            return out
        try:
            dev = os.stat(self.runs if self.runs.exists() else self.runs.parent).st_dev
        except OSError:
            return out
        return {**out, **self._unclaimed_caches(running, dev)}

    def _unclaimed_caches(self, running: list[DiskJob], dev: int) -> dict[Path, tuple[int, int]]:
        """`_unclaimed`'s share of the tenants' caches on the disk `dev`."""
        out: dict[Path, tuple[int, int]] = {}
        if self.cache_root is None:
            return out
        caches = _subdirs(self.cache_root)
        since = self.clock() - self.keep_s
        first: dict[Path, float] = {}
        for j in running:
            if j.cache is not None:
                first[j.cache] = min(first.get(j.cache, j.started), j.started)
        for c in caches:
            window = tree_usage(c, since=since, dev=dev)
            if c in first:  # what its running jobs wrote since they started is theirs
                theirs = tree_usage(c, since=max(since, first[c]), dev=dev)
                window = (window[0] - theirs[0], window[1] - theirs[1])
            out[c] = window
        return out

    def _usage_of(self, job: DiskJob) -> tuple[int, int]:
        """(bytes, files) of the job's own, of its container's writable layer, and of what changed in
        its tenant's cache since its start, where those share the disk (a tenant's writes outside its
        job's dir fill it as well)."""
        own = tree_usage(job.path)
        if job.cache is None and job.layer is None:
            return own
        try:
            dev = os.stat(self.runs if self.runs.exists() else self.runs.parent).st_dev
        except OSError:
            return own
        cached = tree_usage(job.cache, since=job.started, dev=dev) if job.cache is not None else (0, 0)
        layer = tree_usage(job.layer, dev=dev) if job.layer is not None else (0, 0)
        return own[0] + cached[0] + layer[0], own[1] + cached[1] + layer[1]

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
