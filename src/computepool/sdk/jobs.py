"""`pool.run(cmd, …) -> Job`: a job (an allocation with a command) from Python, as `cpool run` submits it.

The request is built by the same code as the CLI's (client/options.py) and goes through the same
client calls (create, get with a long poll, logs by byte offset, cancel, download), so an option
means the same thing, and is refused with the same message, wherever it is given.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from computepool.client.follow import OutageRider
from computepool.client.http import ENDED_STATES, PoolClient
from computepool.client.options import build_request, parse_secrets
from computepool.core.errors import InvalidInput
from computepool.wire.allocations import parse_array

if TYPE_CHECKING:
    from computepool.wire.allocations import AllocationCreate

SHELL = "/bin/sh"
LONG_POLL_S = 10.0
Stream = Literal["stdout", "stderr"]


def _after(items: Sequence[int | str | Job] | None) -> list[dict[str, Any]] | None:
    """`after=[job, 12, "13:any"]`: start once each ended (ok: exit 0, unless `ID:any|failed`)."""
    out: list[dict[str, Any]] = []
    for item in items or []:
        if isinstance(item, Job):
            out.append({"id": item.id, "on": "ok"})
            continue
        ident, _, on = str(item).partition(":")
        if isinstance(item, bool) or not ident.isdigit() or on not in ("", "ok", "any", "failed"):
            raise InvalidInput("after", f"{item!r}: give a Job, ID, 'ID:ok', 'ID:any' or 'ID:failed'")
        out.append({"id": int(ident), "on": on or "ok"})
    return out or None


def job_request(
    command: str | Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    secrets: Sequence[str] | None = None,
    array: str | None = None,
    after: Sequence[int | str | Job] | None = None,
    retries: int = 0,
    retry_on_exit: Sequence[int] | None = None,
    name: str | None = None,
    priority: int = 0,
    **options: Any,
) -> AllocationCreate:
    """The job's request: a string runs by `sh -c`, a list of words as given."""
    if isinstance(command, str):
        if not command.strip():
            raise InvalidInput("command", "nothing to run")
        words = [SHELL, "-c", command.strip()]
    else:
        words = [str(w) for w in command]
        if not words:
            raise InvalidInput("command", "nothing to run")
    if array is not None:
        try:
            parse_array(array)
        except ValueError as e:
            raise InvalidInput("array", str(e)) from None
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 20:
        raise InvalidInput("retries", f"must be a whole number from 0 to 20, got {retries!r}")
    request = build_request(flag="", **options)
    return request.changed(
        command=words,
        env=dict(env) if env else None,
        secrets=parse_secrets(secrets, "secrets"),
        array=array,
        after=_after(after),
        retries=retries or None,
        retry_on_exit=list(retry_on_exit) if retry_on_exit else None,
        name=name,
        priority=priority,
    )


def ship_code(client: PoolClient, code: str | Path) -> str:
    """Pack the directory `code` as `cpool run` does (`.cpoolignore`, credentials left out) and
    upload it unless the pool holds it already; its sha256, for the request's `code`."""
    from computepool.client.archive import pack_with_stats  # tar code: only when shipping

    root = Path(code).expanduser()
    if not root.is_dir():
        raise InvalidInput("code", f"{root}: not a directory")
    data, _stats = pack_with_stats(root)
    sha, _sent = client.put_blob_info(data)
    return sha


def exit_code_of(alloc: Mapping[str, Any]) -> int:
    """The job's own exit code; else 0 only if it was released (ended without one), 1 otherwise."""
    code = alloc.get("exit_code")
    if isinstance(code, int):
        return code
    return 0 if alloc.get("state") == "released" else 1


class Job:
    """A submitted job. For an array, the array's first member: `wait()` waits for all of them."""

    def __init__(self, client: PoolClient, alloc: Mapping[str, Any], rider: OutageRider) -> None:
        self.client = client
        self.id = int(alloc["id"])
        self.array = alloc.get("array_id") is not None
        self._last: dict[str, Any] = dict(alloc)
        self._rider = rider

    def _get(self, wait: float = 0.0) -> dict[str, Any]:
        state = self._last.get("state")
        self._last = self._rider.call(lambda: self.client.get_allocation(self.id, wait=wait, state=state))
        return self._last

    @property
    def state(self) -> str:
        """The job's state now (pending, running, released, failed, cancelled, …)."""
        return str(self._get()["state"])

    @property
    def exit_code(self) -> int | None:
        """Its exit code once it ended, else None."""
        alloc = self._get()
        return exit_code_of(alloc) if alloc["state"] in ENDED_STATES else None

    def _members(self) -> list[dict[str, Any]]:
        items = self._rider.call(lambda: self.client.list_allocations(array=self.id, limit=10_000))
        return sorted(items, key=lambda a: int(a.get("array_index") or 0))

    def wait(self, timeout: float | None = None) -> int:
        """Wait until the job ended and answer its exit code (an array's: 0 if every member's is 0,
        else the first non-zero in index order). TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.array:
                members = self._members()
                if members and all(m["state"] in ENDED_STATES for m in members):
                    return next((c for c in map(exit_code_of, members) if c), 0)
            elif self._last.get("state") in ENDED_STATES or self._get()["state"] in ENDED_STATES:
                return exit_code_of(self._last)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"job {self.id} still {self._last.get('state')} after {timeout}s")
            pause = LONG_POLL_S if left is None else min(LONG_POLL_S, left)
            if self.array:
                time.sleep(min(pause, 0.5))
            else:
                self._get(wait=pause)  # answers as soon as the state changes

    @overload
    def logs(self, follow: Literal[False] = False, stream: Stream = "stdout", rank: int = 0) -> str: ...

    @overload
    def logs(self, follow: Literal[True], stream: Stream = "stdout", rank: int = 0) -> Iterator[str]: ...

    def logs(self, follow: bool = False, stream: Stream = "stdout", rank: int = 0) -> str | Iterator[str]:
        """One stream of its output: all stored so far as one string, or with `follow=True` an
        iterator of lines as they come, ending once the job ended and all is read."""
        if stream not in ("stdout", "stderr"):
            raise InvalidInput("stream", f"expected 'stdout' or 'stderr', got {stream!r}")
        if follow:
            return self._follow(stream, rank)
        return "".join(self._pages(stream, rank, follow=False))

    def _pages(self, stream: Stream, rank: int, *, follow: bool) -> Iterator[str]:
        offsets = {"stdout": 0, "stderr": 0}
        wait = LONG_POLL_S if follow else None
        while True:
            out = self._rider.call(
                lambda: self.client.allocation_logs(
                    self.id,
                    offsets["stdout"],
                    offsets["stderr"],
                    rank=rank,
                    wait=wait,
                )
            )
            got = False
            for name in ("stdout", "stderr"):
                part = out.get(name) or {}
                nxt = int(part.get("next", offsets[name]))
                got = got or nxt > offsets[name]
                offsets[name] = nxt
                if name == stream and part.get("data"):
                    yield str(part["data"])
            if out.get("ended") or (not follow and not got):
                return
            if not got:
                time.sleep(0.2)  # a server that answered at once instead of long-polling

    def _follow(self, stream: Stream, rank: int) -> Iterator[str]:
        pending = ""
        for data in self._pages(stream, rank, follow=True):
            pending += data
            *lines, pending = pending.split("\n")
            yield from lines
        if pending:
            yield pending

    def cancel(self) -> None:
        """Cancel it (an array: every member still live); one that already ended stays as it was."""
        if not self.array:
            self.client.cancel_allocation(self.id)
            return
        for m in self._members():
            if m["state"] not in ENDED_STATES:
                self.client.cancel_allocation(m["id"])

    def download(self, path: str, dest: str | Path = ".", rank: int | None = None) -> Path:
        """Copy `path` of the job's work dir (a file or a directory) to `dest`, like `cpool cp`;
        answers where it landed."""
        return self.client.download(self.id, path, Path(dest), rank=rank)

    def __repr__(self) -> str:
        return f"Job({self.id}, {self._last.get('state')})"
