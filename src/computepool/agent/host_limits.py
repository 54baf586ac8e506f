"""Kernel limits of the whole host, not of a job: raised where each job's own limits bound it.

`fs.aio-max-nr` caps the events of every process's Linux AIO contexts together (io_setup(2)). At
its default, 65536, one unprivileged process takes it all with 16 contexts of 4096 events (2 MiB
of rings); every other job's io_setup then fails with EAGAIN (libaio users: DeepSpeed's NVMe
offload, databases), and no namespace or cgroup holds that count apart. The rings themselves are
charged to the caller's memory cgroup, at least 64 bytes per event counted (the kernel keeps twice
the events asked for, 32 bytes each), so a root agent raises the limit to the node's memory / 32:
a job's memory limit stops it long before the host's count runs out.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

AIO_MAX = Path("sys/fs/aio-max-nr")
BYTES_PER_EVENT = 32  # half of what each counted event costs in ring memory: a margin of two


def node_memory_bytes(proc: Path = Path("/proc")) -> int:
    """MemTotal, in bytes (0 when it cannot be read)."""
    with contextlib.suppress(OSError, ValueError):
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def raise_aio_max(proc: Path = Path("/proc")) -> str:
    """Raise fs.aio-max-nr to the node's memory / BYTES_PER_EVENT where it is below; what was
    done, in words ("" when nothing needed doing)."""
    want = node_memory_bytes(proc) // BYTES_PER_EVENT
    path = proc / AIO_MAX
    try:
        have = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return ""  # no AIO in this kernel
    if want <= have:
        return ""
    try:
        path.write_text(str(want))
    except OSError as e:
        return (
            f"fs.aio-max-nr stays {have} ({e.strerror}): one job can take every AIO context of the "
            f"node (io_setup then fails with EAGAIN in the others); raise it to {want}"
        )
    return f"fs.aio-max-nr raised from {have} to {want}: each job's AIO is held by its memory limit"
