"""Running a vendor's command-line tool: where the tool is missing, fails or hangs, the backend is
unavailable and says why; it never raises to the agent."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence

TOOL_TIMEOUT_S = 15.0
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9_.]+")


class ToolError(Exception):
    """Why a tool gave no answer, in words fit for the backend's `reason`."""


def run_tool(argv: Sequence[str], timeout_s: float = TOOL_TIMEOUT_S) -> str:
    """The tool's standard output. `argv[0]` is a name looked up on PATH, or a path."""
    exe = shutil.which(argv[0])
    if exe is None:
        raise ToolError(f"{argv[0]} not found on PATH")
    shown = " ".join(argv)
    try:
        done = subprocess.run(
            [exe, *argv[1:]], capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        raise ToolError(f"{shown} did not answer in {timeout_s:g} s") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ToolError(f"cannot run {shown}: {e}") from None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise ToolError(f"{shown} exited {done.returncode}" + (f": {said[-1][:200]}" if said else ""))
    return done.stdout


def number(text: object) -> float | None:
    """A number a tool printed ("86.0", 42, "N/A", "NA"), else None."""
    if isinstance(text, bool):
        return None
    if isinstance(text, int | float):
        return float(text)
    try:
        return float(str(text).strip())
    except ValueError:
        return None


def model_name(words: Sequence[str], fallback: str) -> str:
    """Words of a vendor's device name as a model name the pool accepts: letters, digits, `_.-`,
    words joined by `-`, at most 63 characters (`Radeon PRO W7900 (gfx1100)` → `Radeon-PRO-W7900-gfx1100`)."""
    name = "-".join(p for w in words for p in _NOT_IN_NAME.split(w) if p)
    return name[:63].strip("-.") or fallback


def link_groups(indices: Sequence[int], linked: Sequence[tuple[int, int]], prefix: str) -> dict[int, str]:
    """index → `<prefix>-<lowest index>` for devices joined by a direct link, directly or through
    others; a device linked to none has no group."""
    parent = {i: i for i in indices}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in linked:
        if a in parent and b in parent:
            parent[find(a)] = find(b)
    members: dict[int, list[int]] = {}
    for i in indices:
        members.setdefault(find(i), []).append(i)
    return {i: f"{prefix}-{min(m)}" for m in members.values() if len(m) > 1 for i in m}
