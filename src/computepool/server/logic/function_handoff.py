"""Idle function workers parked in a long-poll on this replica, so a submission hands them its calls.

Without it a submitted call waits in the database until a worker's long-poll wakes, reads and
claims it: two more transactions and thread hops on every call's path. With it, the submission
claims the calls for the workers parked here in the very transaction that stores them, and
their long-polls answer at once. The database stays the truth: a call handed over is a call
`running` on that worker, committed, exactly as if the worker had claimed it (if the worker then
dies, the sweep fails it as any claimed call). Workers parked on another replica are not seen:
they find calls within the long-poll's re-check, as before.

The protocol between a submission (a worker thread) and a parked poll (the event loop): `take`
marks a waiter taken under the lock, so a poll that `withdraw`s after that learns it must wait for
its answer; the taker always answers, with the calls or an empty list (the transaction failed).

The other way round, a `.remote()` waiting in its submission for its call's outcome is a `Watch`:
the hand-in that records the outcome reads the call's row in its own transaction and, once that
committed, gives it to the watch, so the caller's answer needs no transaction of its own. It is
only a shortcut: the caller still wakes on the results topic and reads the database when the
watch says nothing (output printed, the call cancelled or failed by the sweep, a worker on
another replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field

from computepool.store.functions import CallRow


@dataclass(eq=False)
class Waiter:
    """One parked worker: its allocation, how many calls it takes, where its answer goes."""

    worker: int
    max_calls: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[tuple[int, str]]]
    taken: bool = field(default=False)

    def answer(self, calls: list[tuple[int, str]]) -> None:
        """From any thread: wake the poll with these calls (empty: go and read the database)."""

        def settle() -> None:
            if not self.future.done():
                self.future.set_result(calls)

        with contextlib.suppress(RuntimeError):  # the loop is shutting down: the poll is gone too
            self.loop.call_soon_threadsafe(settle)


@dataclass(eq=False)
class Watch:
    """A submission of one call waiting on this replica for that call's outcome."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[CallRow]
    call: int = 0  # set by the submission, before its transaction commits

    def answer(self, row: CallRow) -> None:
        """From any thread, after the transaction that ended the call committed."""

        def settle() -> None:
            if not self.future.done():
                self.future.set_result(row)

        with contextlib.suppress(RuntimeError):  # the loop is shutting down: the caller is gone too
            self.loop.call_soon_threadsafe(settle)


class Handoff:
    """Per function, the workers parked in this replica's long-polls, oldest first; per call, the
    submission waiting here for its outcome."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parked: dict[int, list[Waiter]] = {}
        self._watches: dict[int, Watch] = {}

    def park(self, fid: int, waiter: Waiter) -> None:
        with self._lock:
            self._parked.setdefault(fid, []).append(waiter)

    def withdraw(self, fid: int, waiter: Waiter) -> bool:
        """Unpark; False when a submission took it first (its answer is on the way)."""
        with self._lock:
            if waiter.taken:
                return False
            group = self._parked.get(fid)
            if group is not None:
                with contextlib.suppress(ValueError):
                    group.remove(waiter)
                if not group:
                    del self._parked[fid]
            return True

    def take(self, fid: int, count: int) -> list[Waiter]:
        """Up to `count` parked workers of the function, now the caller's to answer."""
        if count <= 0:
            return []
        with self._lock:
            group = self._parked.get(fid)
            if not group:
                return []
            taken, rest = group[:count], group[count:]
            if rest:
                self._parked[fid] = rest
            else:
                del self._parked[fid]
            for w in taken:
                w.taken = True
            return taken

    def parked(self, fid: int) -> int:
        with self._lock:
            return len(self._parked.get(fid, ()))

    def watch(self, call: int, watch: Watch) -> None:
        """The submission of `call` waits here for its outcome (called before it commits)."""
        with self._lock:
            watch.call = call
            self._watches[call] = watch

    def unwatch(self, watch: Watch) -> None:
        with self._lock:
            if self._watches.get(watch.call) is watch:
                del self._watches[watch.call]

    def watching(self) -> int:
        """Submissions waiting here for their call's outcome."""
        with self._lock:
            return len(self._watches)

    def watched(self, calls: list[int]) -> list[Watch]:
        """The watches of any of these calls (the hand-in then reads their rows for them)."""
        if not self._watches:
            return []
        with self._lock:
            return [w for c in calls if (w := self._watches.get(c)) is not None]
