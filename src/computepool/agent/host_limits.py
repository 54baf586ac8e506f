"""Kernel counts of the whole host, not of a job: raised where each job's memory limit bounds it.

No namespace or cgroup holds these apart, so one tenant's job could take all of one and fail
every other tenant's jobs:

- `fs.aio-max-nr` counts the events of every process's Linux AIO contexts (io_setup(2)). At its
  default, 65536, one process takes it all with 16 contexts of 4096 events (2 MiB of rings);
  every other job's io_setup then fails with EAGAIN (libaio: DeepSpeed's NVMe offload, databases).
  The rings are charged to the caller's memory cgroup, at least 64 bytes per event counted.
- `fs.file-max` counts every open file of the host. The kernel sizes it at a tenth of memory / 1
  KiB: a job of 1/40 of the node's memory opens that many (forked children of 20000 files each)
  and every unprivileged process of the node (other tenants' jobs) gets ENFILE from open, socket
  and pipe. Each open file is a slab object (~256 bytes) charged to the opener's memory cgroup.
- `kernel.pty.max` (4096) counts every pty. A process job has a devpts instance of its own, of at
  most sandbox.JOB_PTYS, and all those instances together stay below the host's reserve
  (`kernel.pty.reserve`), which keeps the node's own terminals (sshd); raised to the kernel's
  ceiling (2^20), it leaves the jobs' instances room for about a thousand jobs' worth (each pty
  charges its opener ~3 KiB).

A root agent raises each to the node's memory / half what one unit costs there (systemd sets
file-max to its highest value for the same reason): a job's memory limit stops it long before the
host's count runs out.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostCount:
    sysctl: str  # the path below /proc/sys, dotted as sysctl(8) names it
    unit_bytes: int  # half of what one unit costs in the memory cgroup of who takes it: a margin of two
    what: str  # what a job gets once another took every unit
    most: int = 0  # the kernel's ceiling for it (0: none)


COUNTS = (
    HostCount("fs.aio-max-nr", 32, "io_setup fails with EAGAIN"),
    HostCount("fs.file-max", 128, "open, socket and pipe fail with ENFILE"),
    HostCount("kernel.pty.max", 1536, "opening /dev/ptmx fails with ENOSPC", 1 << 20),
)


def node_memory_bytes(proc: Path = Path("/proc")) -> int:
    """MemTotal, in bytes (0 when it cannot be read)."""
    with contextlib.suppress(OSError, ValueError):
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def wanted(count: HostCount, proc: Path = Path("/proc")) -> int:
    """The value at which no job can take all of `count` within the node's memory."""
    want = node_memory_bytes(proc) // count.unit_bytes
    return min(want, count.most) if count.most else want


def raise_counts(proc: Path = Path("/proc")) -> list[tuple[bool, str]]:
    """Raise each of COUNTS where it is below `wanted`; (done, what in words) for each changed or
    left too low (done False: the agent may not write it, e.g. in a container)."""
    out: list[tuple[bool, str]] = []
    for count in COUNTS:
        path = proc / "sys" / count.sysctl.replace(".", "/")
        want = wanted(count, proc)
        try:
            have = int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # not in this kernel
        if want <= have:
            continue
        try:
            path.write_text(str(want))
        except OSError as e:
            out.append((False, f"{count.sysctl} stays {have} ({e.strerror}): one job can take all of it and "
                               f"in every other job {count.what}; raise it to {want}"))  # fmt: skip
            continue
        out.append(
            (
                True,
                f"{count.sysctl} raised from {have} to {want}: each job's share is held by its memory limit",
            )
        )
    return out
