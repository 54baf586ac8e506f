"""Reading running jobs' progress files (sdk/progress.py) into steps/s for the heartbeat.

Each heartbeat reads every running job's file once; a job whose step count grew since the last
read is reported with (steps since) / (time between the two writes), both as the job wrote them,
so the agent's own timing does not blur the figure. A file that did not change, went backwards
(a counter reset), is missing or is not the expected JSON says nothing. The file lies in the
tenant's work dir, so it is opened beneath the work dir's descriptor with O_NOFOLLOW and
O_NONBLOCK (never through a link, never blocking on a FIFO) and read only when a small regular file.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from computepool.agent.jobfiles import dir_fd
from computepool.core.progress import MAX_BYTES, PROGRESS_FILE, decode

MAX_RATE = 1e9  # the wire's ceiling (wire/nodes.py ProgressIn)


def read_progress(work_dir: Path) -> tuple[int, float] | None:
    """(step, time) from the job's progress file, or None when absent or not valid."""
    try:
        with dir_fd(work_dir) as d:
            fd = os.open(PROGRESS_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=d)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
                    return None
                data = f.read(MAX_BYTES)
    except OSError:
        return None
    return decode(data)


@dataclass(frozen=True)
class RunningJob:
    key: str
    allocation_id: str
    attempt: int
    work_dir: Path


class ProgressReader:
    """The last (step, time) seen of each running job, and the steps/s since."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, float]] = {}

    def rates(self, jobs: Iterable[RunningJob]) -> list[dict[str, Any]]:
        """The heartbeat's `progress`: one entry per job that advanced since the last call."""
        out: list[dict[str, Any]] = []
        seen: set[str] = set()
        for job in jobs:
            seen.add(job.key)
            got = read_progress(job.work_dir)
            if got is None:
                continue
            prev = self._last.get(job.key)
            if prev is not None and got[0] == prev[0]:
                continue  # no step since: stale, nothing to say
            self._last[job.key] = got
            if prev is None or got[0] < prev[0] or got[1] <= prev[1] or not job.allocation_id.isdigit():
                continue  # a first sight, or a counter that started again: a base for the next read
            rate = (got[0] - prev[0]) / (got[1] - prev[1])
            if 0 < rate <= MAX_RATE:
                out.append(
                    {"allocation_id": int(job.allocation_id), "attempt": job.attempt, "steps_per_s": rate}
                )
        for gone in set(self._last) - seen:
            del self._last[gone]
        return out
