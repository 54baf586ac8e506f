"""`computepool.progress(step)`: a job says how far it got, so the pool learns its speed.

The agent names a file for each job in `CPOOL_PROGRESS_FILE` (in the job's work dir) and reads it
at every heartbeat: the steps done since the last read over the time between the two writes give
the job's steps/s, which the control plane keeps per job type and device model
(`cpool run --job-type`) and uses to place the type on the model it runs fastest on.

The file is one JSON object, `{"step": 1200, "time": 1733107200.5}` (the step count, a whole
number that only grows within an attempt, and the Unix time it was reached), replaced whole
(written to a temporary file beside it, then renamed over it) so that a reader never sees half of
it. A job that does not use this SDK can write the same file itself in any language.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from computepool.core.progress import MAX_STEP, PROGRESS_ENV, encode


def progress(step: int) -> bool:
    """Record that the job has done `step` steps (call it every few steps; each call writes a tiny
    file). Returns False, writing nothing, outside the pool (no `CPOOL_PROGRESS_FILE`).

    Raises ValueError for a step that is not a whole number from 0 to 2**62.
    """
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"computepool.progress: step must be a whole number from 0 to 2**62, got {step!r}")
    target = os.environ.get(PROGRESS_ENV, "")
    if not target:
        return False
    write_progress(Path(target), step, time.time())
    return True


def write_progress(path: Path, step: int, at: float) -> None:
    """Replace `path` with `{"step": step, "time": at}` in one rename (never half written)."""
    data = encode(step, at)
    fd, tmp = tempfile.mkstemp(prefix=".cpool-progress.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
