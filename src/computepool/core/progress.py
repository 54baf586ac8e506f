"""A job's progress file, shared by the SDK that writes it and the agent that reads it.

One JSON object, `{"step": 1200, "time": 1733107200.5}`: the steps done so far (a whole number
that only grows within an attempt) and the Unix time it was reached, replaced whole by a rename.
The agent puts its path in the job's `CPOOL_PROGRESS_FILE`, in the job's work dir.
"""

from __future__ import annotations

import json
import math
from typing import Any

PROGRESS_ENV = "CPOOL_PROGRESS_FILE"
PROGRESS_FILE = ".cpool-progress"  # its name in the job's work dir
MAX_STEP = 2**62
MAX_BYTES = 4096


def encode(step: int, at: float) -> bytes:
    return json.dumps({"step": step, "time": round(at, 6)}).encode()


def decode(data: bytes) -> tuple[int, float] | None:
    """(step, time), or None when `data` is not a progress file's content."""
    try:
        doc: Any = json.loads(data)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    step, at = doc.get("step"), doc.get("time")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        return None
    if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
        return None
    return step, float(at)
