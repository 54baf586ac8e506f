"""Tenant B fills the node's disk, through its tenant cache or with empty files, to have the disk
guard stop A's job or to leave no file for anyone.

The disk guard stops, on a nearly full disk, the running job whose files take the most. It used to
count each job's own dir alone; B's job wrote its fill to `CPOOL_CACHE_DIR` (its tenant's cache,
on the same disk, outside its job's dir) and A's job, with a few MiB of its own, was the one
stopped. What a job writes to its tenant's cache now counts as its own; what was there before it
started (A's large cache, written by earlier jobs) does not. And the guard looked at bytes alone:
a job making empty files without end took every inode of the disk, and nobody could create a file.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent.disk_guard import DiskGuard, DiskJob
from computepool.agent.localstate import job_key

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")]
MIB = 1 << 20


@pytest.fixture
def disk() -> Iterator[Path]:
    """A 48 MiB disk of 3000 inodes holding the agent's runs and the tenants' caches."""
    d = Path("/var/tmp") / f"cpool-disk-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,nr_inodes=3000", "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
        d.rmdir()


def _write(path: Path, mib: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * (mib * MIB))


def test_a_tenant_filling_its_cache_is_the_one_stopped(disk: Path) -> None:
    runs, caches = disk / "runs", disk / "cache"
    _write(caches / "a" / "pip" / "wheels.bin", 12)  # A's cache, from its earlier jobs
    a_started = time.time()
    _write(runs / "1" / "1" / "work" / "model.bin", 4)  # A's running job: its own files
    b_started = time.time()
    _write(runs / "2" / "1" / "work" / "x", 0)
    _write(caches / "b" / "fill.bin", 24)  # B's running job fills the disk through its cache
    jobs = [
        DiskJob(job_key("1", 1), runs / "1" / "1", caches / "a", a_started),
        DiskJob(job_key("2", 1), runs / "2" / "1", caches / "b", b_started),
    ]
    stopped: list[tuple[str, str]] = []
    g = DiskGuard(
        runs, job_key, lambda: {j.key for j in jobs}, lambda: jobs, lambda k, r: stopped.append((k, r)),
        min_free_bytes=16 * MIB, min_free_share=0.5,
    )  # fmt: skip
    assert g.low()[0]
    assert g.check_once() == [f"stopped {job_key('2', 1)}"]
    [(key, reason)] = stopped
    assert key == job_key("2", 1) and "its container's own files) took 24 MiB" in reason, reason


def test_a_cache_on_another_disk_is_not_counted(disk: Path, tmp_path: Path) -> None:
    """Writes elsewhere do not fill this disk: the job that does is stopped."""
    runs = disk / "runs"
    started = time.time()
    _write(runs / "1" / "1" / "work" / "fill.bin", 30)
    _write(tmp_path / "cache-b" / "big.bin", 40)  # another filesystem
    jobs = [
        DiskJob(job_key("1", 1), runs / "1" / "1", None, started),
        DiskJob(job_key("2", 1), runs / "2" / "1", tmp_path / "cache-b", started),
    ]
    stopped: list[tuple[str, str]] = []
    g = DiskGuard(
        runs, job_key, lambda: {j.key for j in jobs}, lambda: jobs, lambda k, r: stopped.append((k, r)),
        min_free_bytes=24 * MIB, min_free_share=0.5,
    )  # fmt: skip
    assert g.check_once() == [f"stopped {job_key('1', 1)}"]


def test_a_job_taking_every_inode_is_stopped(disk: Path) -> None:
    runs = disk / "runs"
    started = time.time()
    _write(runs / "1" / "1" / "work" / "model.bin", 8)  # A: bytes, few files
    many = runs / "2" / "1" / "work"
    many.mkdir(parents=True)
    for i in range(2600):  # B: empty files until the disk has hardly an inode left
        (many / f"f{i}").touch()
    jobs = [
        DiskJob(job_key("1", 1), runs / "1" / "1", None, started),
        DiskJob(job_key("2", 1), runs / "2" / "1"),
    ]
    stopped: list[tuple[str, str]] = []
    g = DiskGuard(
        runs, job_key, lambda: {j.key for j in jobs}, lambda: jobs, lambda k, r: stopped.append((k, r)),
        min_free_bytes=8 * MIB, min_free_share=0.5, min_free_inodes=1000,
    )  # fmt: skip
    assert not g.low()[0] and g.inodes_low()[0]
    assert g.check_once() == [f"stopped {job_key('2', 1)}"]
    [(key, reason)] = stopped
    assert "the node's disk is out of inodes" in reason and "took 260" in reason, reason


def test_a_cache_filled_by_a_job_no_longer_running_stops_no_one_else(disk: Path) -> None:
    """B's job fills B's cache and is stopped for it (or ends before the guard looks): what it wrote
    stays, the disk stays low, and the guard stopped the next biggest running job, A's 4 MiB, then
    the next, every job of every tenant in turn. Recent cache writes no running job answers for
    (the whole last hour's of a tenant none of whose jobs runs, or those before its running jobs
    started) now hold the guard back: it stops no job smaller than them."""
    runs, caches = disk / "runs", disk / "cache"
    a_started = time.time()
    _write(runs / "1" / "1" / "work" / "model.bin", 4)  # A's running job: its own files
    b_started = time.time()
    _write(caches / "b" / "fill.bin", 30)  # B's running job fills the disk through its cache
    jobs = [
        DiskJob(job_key("1", 1), runs / "1" / "1", caches / "a", a_started),
        DiskJob(job_key("2", 1), runs / "2" / "1", caches / "b", b_started),
    ]
    stopped: list[tuple[str, str]] = []
    g = DiskGuard(
        runs, job_key, lambda: {j.key for j in jobs}, lambda: jobs, lambda k, r: stopped.append((k, r)),
        min_free_bytes=16 * MIB, min_free_share=0.5, cache_root=caches,
    )  # fmt: skip
    assert g.check_once() == [f"stopped {job_key('2', 1)}"]  # B's, for its cache
    del jobs[1]  # stopped: its cache keeps what it wrote, the disk stays low
    time.sleep(0.05)
    jobs.append(DiskJob(job_key("3", 1), runs / "3" / "1", caches / "b", time.time()))  # B's next job
    for _ in range(3):
        assert g.low()[0]
        assert g.check_once() == [], stopped
    assert [k for k, _ in stopped] == [job_key("2", 1)], stopped


def test_the_files_of_a_job_just_stopped_for_them_stop_no_one_else(disk: Path) -> None:
    """The guard stops B's job for filling its dir; the dir stays a minute (or until its end is
    acknowledged) and the disk with it low: the guard stopped A's 4 MiB job next, and another
    every pass of that minute. A run dir no running job holds now holds the guard back as well."""
    runs = disk / "runs"
    started = time.time()
    _write(runs / "1" / "1" / "work" / "model.bin", 4)  # A
    _write(runs / "2" / "1" / "work" / "fill.bin", 30)  # B fills its own dir
    jobs = [
        DiskJob(job_key("1", 1), runs / "1" / "1", None, started),
        DiskJob(job_key("2", 1), runs / "2" / "1"),
    ]
    stopped: list[tuple[str, str]] = []
    g = DiskGuard(
        runs, job_key, lambda: {j.key for j in jobs}, lambda: jobs, lambda k, r: stopped.append((k, r)),
        min_free_bytes=16 * MIB, min_free_share=0.5,
    )  # fmt: skip
    assert g.check_once() == [f"stopped {job_key('2', 1)}"]
    del jobs[1]  # ended: its dir is kept (its end not yet acknowledged, then MIN_KEEP_S)
    for _ in range(3):
        assert g.low()[0]
        assert g.check_once() == [], stopped
    assert [k for k, _ in stopped] == [job_key("2", 1)], stopped


def test_a_cache_on_a_disk_of_its_own_filled_by_a_job_stops_that_job(disk: Path, tmp_path: Path) -> None:
    """The tenants' caches (`/var/cache/computepool`, often the node's root disk) on another disk than
    the data dir's (a big one for the runs): the guard watched the data dir's disk alone, so B's
    job filled the caches' disk through its cache, and every tenant's cache, podman's storage and
    the node's own files there with it. While that disk is low, the running job that wrote the
    most to its tenant's cache since it started is stopped; A's job, which wrote none, runs on."""
    caches = tmp_path / "caches"  # the caches' own 32 MiB disk
    caches.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(caches)], check=True)
    try:
        runs = disk / "runs"
        _write(caches / "a" / "pip" / "wheels.bin", 4)  # A's cache, from its earlier jobs
        time.sleep(0.05)  # files' times come from a coarser clock than time.time()
        started = time.time()
        _write(runs / "1" / "1" / "work" / "model.bin", 8)  # A's running job: its own files
        _write(runs / "2" / "1" / "work" / "x", 0)
        _write(caches / "b" / "fill.bin", 24)  # B's running job fills the caches' disk
        jobs = [
            DiskJob(job_key("1", 1), runs / "1" / "1", caches / "a", started),
            DiskJob(job_key("2", 1), runs / "2" / "1", caches / "b", started),
        ]
        stopped: list[tuple[str, str]] = []
        g = DiskGuard(
            runs, job_key, lambda: {j.key for j in jobs}, lambda: jobs, lambda k, r: stopped.append((k, r)),
            min_free_bytes=8 * MIB, min_free_share=0.25, cache_root=caches,
        )  # fmt: skip
        assert not g.low()[0] and g.low(caches)[0]  # the data dir's disk has room; the caches' not
        assert g.check_once() == [f"stopped {job_key('2', 1)}"]
        [(key, reason)] = stopped
        assert "tenants' caches is nearly full" in reason and "took 24 MiB" in reason, reason
        assert g.check_once() == []  # once: what it wrote stays; no other job is stopped for it
    finally:
        subprocess.run(["umount", "-l", str(caches)], check=False)
