"""A job's output on the caller's terminal: its stdout on our stdout, its stderr on our stderr.

`cpool run` and `cpool logs` share this loop. The server keeps the two streams apart with an offset
each, so one request per poll moves both; each stream's bytes reach their own file descriptor in
order, and nothing of one is ever spliced into a line of the other.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from computepool.cli.common import err_console
from computepool.client import PoolClient
from computepool.client.follow import OutageRider

WAIT_S = 10.0
NO_WAIT_PAUSE_S = 0.2  # against a server that answers at once instead of long-polling


def _write(fd: TextIO, data: str) -> None:
    if data:
        fd.write(data)
        fd.flush()


def follower(what: str) -> OutageRider:
    """Rides out a control-plane outage while following `what`, saying so once on stderr."""

    def gone(e: Exception) -> None:
        err_console.print(
            f"{e}; still following {what}, retrying", highlight=False, markup=False, style="dim"
        )

    def back() -> None:
        err_console.print(f"control plane back; following {what}", highlight=False, markup=False, style="dim")

    return OutageRider(on_outage=gone, on_back=back)


def copy_output(
    pool: PoolClient,
    alloc_id: str,
    *,
    rank: int = 0,
    follow: bool = True,
    wait: float = WAIT_S,
    first: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Copy a member's output from the start; with `follow`, until the job ended and all is out.

    Without `follow`, every page up to what is stored now (a long log is not cut at one page).
    `first` sees the first answer before anything is written (to say whose output it is).
    Returns the last answer: its state, exit code and reason say how the job ended. While
    following, a control plane that restarts or fails over is waited for (`follower`).
    """
    offsets = {"stdout": 0, "stderr": 0}
    rider = follower(f"job {alloc_id}") if follow else OutageRider(outage_s=0)
    while True:
        out = rider.call(
            lambda: pool.allocation_logs(
                alloc_id, offsets["stdout"], offsets["stderr"], rank=rank, wait=wait if follow else None
            )
        )
        if first is not None:
            first(out)
            first = None
        got = False
        for name, fd in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            part = out.get(name) or {}
            _write(fd, str(part.get("data") or ""))
            nxt = int(part.get("next", offsets[name]))
            got = got or nxt > offsets[name]
            offsets[name] = nxt
        if out.get("ended") or (not follow and not got):
            return out
        if not got:
            time.sleep(NO_WAIT_PAUSE_S)


def ended_line(alloc_id: str, out: dict[str, Any]) -> str:
    """One line on how a job ended: `job 7 failed (exit code 3): exited with code 3`."""
    code = out.get("exit_code")
    how = f" (exit code {code})" if isinstance(code, int) else ""
    return f"job {alloc_id} {out.get('state')}{how}: {out.get('reason') or 'no reason given'}"


def exit_code(out: dict[str, Any]) -> int:
    """The exit code `cpool run` and `cpool logs -f` end with: the job's own, else 0 only if released."""
    code = out.get("exit_code")
    if isinstance(code, int):
        return code if 0 <= code < 256 else 1
    return 0 if out.get("state") == "released" else 1
