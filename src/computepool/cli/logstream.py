"""A job's output on the caller's terminal: its stdout on our stdout, its stderr on our stderr.

`cpool run` and `cpool logs` share this loop. The server keeps the two streams apart with an offset
each, so one request per poll moves both; each stream's bytes reach their own file descriptor in
order, and nothing of one is ever spliced into a line of the other.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from functools import partial
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
    rank: int | None = None,
    follow: bool = True,
    wait: float = WAIT_S,
    first: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Copy a job's output from the start; with `follow`, until the job ended and all is out.

    A gang's members all have their say, each line prefixed `[rank N]`, unless `rank` picks one
    (then unprefixed, as a single node's). Without `follow`, every page up to what is stored now
    (a long log is not cut at one page). `first` sees the first answer before anything is written
    (to say whose output it is). Returns the last answer: its state, exit code and reason say how
    the job ended. While following, a control plane that restarts or fails over is waited for.
    """
    rider = follower(f"job {alloc_id}") if follow else OutageRider(outage_s=0)
    members = [_Member(rank or 0)]
    while True:
        got, out = False, {}
        long_poll = wait if follow and len(members) == 1 else None  # a gang's members: polled in turn
        for m in members:
            offsets = m.offsets["stdout"], m.offsets["stderr"]
            out = rider.call(partial(pool.allocation_logs, alloc_id, *offsets, rank=m.rank, wait=long_poll))
            if first is not None:
                first(out)
                first = None
            if rank is None and len(members) == 1 and int(out.get("ranks") or 1) > 1:
                members = [members[0], *(_Member(r, True) for r in range(1, int(out["ranks"])))]
                members[0].prefix = True
                got = True  # the other members are read next, whatever rank 0 said
            got = m.take(out) or got
            m.ended = bool(out.get("ended"))
        if all(m.ended for m in members) or (not follow and not got):
            for m in members:
                m.flush()
            return out
        if not got:
            time.sleep(NO_WAIT_PAUSE_S)


class _Member:
    """One gang member's offsets, and (when prefixed) the part of a line not yet ended."""

    def __init__(self, rank: int, prefix: bool = False) -> None:
        self.rank, self.prefix, self.ended = rank, prefix, False
        self.offsets = {"stdout": 0, "stderr": 0}
        self.partial = {"stdout": "", "stderr": ""}

    def take(self, out: dict[str, Any]) -> bool:
        """Write what `out` brought; whether it brought anything."""
        got = False
        for name, fd in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            part = out.get(name) or {}
            data = str(part.get("data") or "")
            if self.prefix:
                *lines, self.partial[name] = (self.partial[name] + data).split("\n")
                data = "".join(f"[rank {self.rank}] {line}\n" for line in lines)
            _write(fd, data)
            nxt = int(part.get("next", self.offsets[name]))
            got = got or nxt > self.offsets[name]
            self.offsets[name] = nxt
        return got

    def flush(self) -> None:
        """A last line without its newline, once the output is all read."""
        for name, fd in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            if self.prefix and self.partial[name]:
                _write(fd, f"[rank {self.rank}] {self.partial[name]}\n")
                self.partial[name] = ""


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
