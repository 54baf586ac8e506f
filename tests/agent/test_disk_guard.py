"""The disk guard on a real small tmpfs: finished attempts' dirs go after their keeping time (at
once, oldest first, when the disk is low), nothing the agent still uses is touched, and a real job
writing until the disk is nearly full is stopped with a reason naming the sizes."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent.disk_guard import MIN_KEEP_S, DiskGuard, DiskJob, tree_bytes
from computepool.agent.executor import Executor, JobSpec
from computepool.agent.localstate import JobState, job_key

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")]
MIB = 1 << 20
NOW = 2_000_000_000.0


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "disk"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def attempt(runs: Path, alloc: str, n: int, mib: int, ended: float) -> Path:
    d = runs / alloc / str(n)
    (d / "work").mkdir(parents=True)
    (d / "work" / "out.bin").write_bytes(b"x" * (mib * MIB))
    for p in (d / "work" / "out.bin", d / "work", d):
        os.utime(p, (ended, ended))
    return d


def guard(runs: Path, protected: set[str], jobs: list[DiskJob], stopped: list[tuple[str, str]]) -> DiskGuard:
    return DiskGuard(
        runs, job_key, lambda: protected, lambda: jobs, lambda k, r: stopped.append((k, r)),
        keep_s=3600, min_free_bytes=8 * MIB, min_free_share=0.25, clock=lambda: NOW,
    )  # fmt: skip


def test_finished_dirs_go_after_their_keeping_and_what_is_used_stays(disk: Path) -> None:
    runs = disk / "runs"
    old = attempt(runs, "1", 1, 1, NOW - 7200)
    fresh = attempt(runs, "2", 1, 1, NOW - 600)
    unacknowledged = attempt(runs, "3", 1, 1, NOW - 7200)
    stopped: list[tuple[str, str]] = []
    g = guard(runs, {job_key("3", 1)}, [], stopped)
    assert not g.low()[0]
    assert g.check_once() == [f"removed {old}"]
    assert not old.exists() and not old.parent.exists()  # the allocation's dir with its last attempt
    assert fresh.exists() and unacknowledged.exists() and stopped == []


def test_a_low_disk_removes_the_oldest_finished_first_until_it_is_not(disk: Path) -> None:
    runs = disk / "runs"
    a = attempt(runs, "1", 1, 9, NOW - 1200)
    b = attempt(runs, "1", 2, 9, NOW - 900)
    young = attempt(runs, "2", 1, 9, NOW - MIN_KEEP_S / 2)  # just ended: `--output` may still fetch it
    stopped: list[tuple[str, str]] = []
    g = guard(runs, set(), [], stopped)
    assert g.low()[0]  # 27 MiB of 32 used: under a quarter free
    assert g.check_once() == [f"removed {a}"]  # one was enough
    assert not a.exists() and b.exists() and young.exists() and stopped == []
    assert not g.low()[0]


def test_a_low_disk_with_nothing_finished_stops_the_job_with_the_most_files(disk: Path) -> None:
    runs = disk / "runs"
    big = attempt(runs, "7", 1, 20, NOW)
    small = attempt(runs, "8", 1, 5, NOW)
    running = [DiskJob(job_key("7", 1), big), DiskJob(job_key("8", 1), small)]
    stopped: list[tuple[str, str]] = []
    g = guard(runs, {j.key for j in running}, running, stopped)
    assert g.check_once() == [f"stopped {job_key('7', 1)}"]
    [(key, reason)] = stopped
    assert key == job_key("7", 1) and "the node's disk is nearly full" in reason and "took 20 MiB" in reason
    # still low, with 7's 20 MiB kept until its end is acknowledged: stopping 8 (5 MiB, another
    # tenant's maybe) would free none of it, so 8 runs on; 7 is never stopped twice
    assert g.check_once() == []
    assert g.check_once() == [] and [k for k, _ in stopped] == [job_key("7", 1)]
    assert big.exists() and small.exists()  # kept until their ends are acknowledged
    assert tree_bytes(big) >= 20 * MIB


def test_a_real_job_filling_the_disk_is_stopped(disk: Path) -> None:
    ex = Executor(disk / "agent", cgroup_base=None, kill_grace_s=1)
    # fills all but 6 MiB and holds it (a disk filled to the brim would fail the agent's own writes
    # here: on tmpfs root has no reserved blocks, as it has on ext4)
    fill = (
        "import os, time\n"
        "with open('fill', 'wb') as f:\n"
        "    while os.statvfs('.').f_bavail * os.statvfs('.').f_frsize > 6 << 20:\n"
        "        f.write(b'x' * 65536); f.flush()\n"
        "time.sleep(600)"
    )
    rec = ex.start(JobSpec("fill", 1, ["python3", "-c", fill]))
    g = DiskGuard(
        disk / "agent" / "runs", job_key, lambda: {r.key for r in ex.running()},
        lambda: [DiskJob(r.key, Path(r.run_dir)) for r in ex.running()], ex.stop,
        min_free_bytes=8 * MIB, min_free_share=0.25,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not g.check_once() and time.monotonic() < deadline:
            time.sleep(0.1)
        done = ex.wait(rec.key, 30)
        assert done.state is JobState.KILLED, done
        assert "the node's disk is nearly full" in done.reason and "the most of any job's" in done.reason
    finally:
        for r in ex.running():
            ex.kill(r.key, "test teardown", grace_s=0)
        ex.close()
        ex.state.close()


def test_a_containers_writes_into_its_image_count_as_its_own(disk: Path) -> None:
    """A container filling its image's own dirs (its writable layer) is the one stopped, not the
    job whose run dir is bigger; a layer on another filesystem does not count."""
    runs = disk / "runs"
    process_job = attempt(runs, "7", 1, 8, NOW)
    container_job = attempt(runs, "8", 1, 1, NOW)
    layer = disk / "storage" / "overlay" / "abc" / "diff"  # where podman keeps what it wrote
    (layer / "opt").mkdir(parents=True)
    (layer / "opt" / "fill.bin").write_bytes(b"x" * (16 * MIB))
    running = [DiskJob(job_key("7", 1), process_job), DiskJob(job_key("8", 1), container_job, layer=layer)]
    stopped: list[tuple[str, str]] = []
    g = guard(runs, {j.key for j in running}, running, stopped)
    assert g.check_once() == [f"stopped {job_key('8', 1)}"]
    assert "took 17 MiB" in stopped[0][1] and "its container's own files" in stopped[0][1]
    elsewhere = DiskJob(job_key("8", 1), container_job, layer=Path("/proc/self"))  # another device
    assert g._usage_of(elsewhere) == g._usage_of(DiskJob(job_key("8", 1), container_job))


def test_a_container_filling_container_storage_on_a_disk_of_its_own_is_stopped(
    disk: Path, tmp_path: Path
) -> None:
    """podman's storage on another disk than the data dir's: while that one is low, the container
    whose writable layer there takes the most is stopped, though the data dir's disk is fine."""
    storage = tmp_path / "storage"
    storage.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(storage)], check=True)
    try:
        runs = disk / "runs"
        big, small = attempt(runs, "7", 1, 1, NOW), attempt(runs, "8", 1, 1, NOW)
        layers = [storage / "overlay" / name / "diff" for name in ("aaa", "bbb")]
        for layer, mib in zip(layers, (25, 2), strict=True):
            (layer / "opt").mkdir(parents=True)
            (layer / "opt" / "fill.bin").write_bytes(b"x" * (mib * MIB))
        running = [
            DiskJob(job_key("7", 1), big, layer=layers[0]),
            DiskJob(job_key("8", 1), small, layer=layers[1]),
        ]
        stopped: list[tuple[str, str]] = []
        g = guard(runs, {j.key for j in running}, running, stopped)
        assert not g.low()[0]  # the data dir's disk has room
        assert g.check_once() == [f"stopped {job_key('7', 1)}"]
        assert "container storage is nearly full" in stopped[0][1] and "took 25 MiB" in stopped[0][1]
        assert g.check_once() == []  # once: its layer stays until its container goes, stopping
        running.pop(0)  # no other container for it (the agent lists it no more once it is stopping)
        assert g.check_once() == []
    finally:
        subprocess.run(["umount", "-l", str(storage)], check=False)
