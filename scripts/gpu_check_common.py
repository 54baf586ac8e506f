"""The GPU check's result table, shared by scripts/gpu_check.py and its gpu_check_*.py parts.

A check records PASS, FAIL, SKIP (could not run here, with the reason) or INFO (a measurement).
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
RESULTS: list[dict[str, str]] = []


def record(name: str, status: str, detail: str) -> None:
    """One result, printed now and, under $OUT, appended to gpu-check.jsonl (kept if a timeout hits)."""
    RESULTS.append({"check": name, "status": status, "detail": detail})
    print(f"  {status:<5} {name}: {detail}", flush=True)
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "gpu-check.jsonl", "a") as f:
            f.write(json.dumps(RESULTS[-1]) + "\n")


def guarded(name: str, fn: Callable[[], T]) -> T | None:
    """A check that raises is a FAIL with its exception (and None), and the other checks still run."""
    try:
        return fn()
    except Exception as e:
        record(name, "FAIL", f"{type(e).__name__}: {e}")
        traceback.print_exc()
        return None


def last_json(path: Path) -> dict[str, object]:
    """The last line of a job's stdout as JSON ({} when there is none, {"raw": …} when not JSON)."""
    try:
        lines = path.read_text().strip().splitlines()
    except OSError:
        return {}
    if not lines:
        return {}
    try:
        value = json.loads(lines[-1])
    except ValueError:
        return {"raw": lines[-1][:300]}
    return value if isinstance(value, dict) else {"raw": lines[-1][:300]}


def tail(path: Path, chars: int = 300) -> str:
    try:
        return path.read_text()[-chars:].strip()
    except OSError:
        return ""
