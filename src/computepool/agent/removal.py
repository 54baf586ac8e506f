"""Removing ended containers off the executor's lock.

`podman rm` takes a few tenths of a second per container, and removing a container's cgroups may
wait for the kernel a little longer. Done under the executor's lock, many jobs ending at once
would hold up every start, stop and poll of the agent; so the executor hands the keys to one
background thread instead, through a bounded queue. When the queue is full (or the remover is
closed) the caller removes the container itself, as before: back-pressure rather than unbounded
memory. Whoever waits for a job's end (`Executor.wait`) also waits for its container to go, and
a job started again under the same key waits for the old container's removal first.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable

DEFAULT_QUEUE_SIZE = 256


class Remover:
    """Runs `remove(key)` for each submitted key on one daemon thread, started on first use."""

    def __init__(self, remove: Callable[[str], None], maxsize: int = DEFAULT_QUEUE_SIZE) -> None:
        self._remove = remove
        self._queue: queue.Queue[str | None] = queue.Queue(maxsize)
        self._pending: set[str] = set()  # queued or being removed now
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, key: str) -> None:
        """Remove the key's container soon; here and now when the queue is full or closed."""
        with self._cond:
            if key in self._pending:
                return  # one removal is still to come: it covers this one too
            inline = self._closed
            if not inline:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="cpool-remover", daemon=True)
                    self._thread.start()
                self._pending.add(key)
                try:
                    self._queue.put_nowait(key)
                except queue.Full:
                    self._pending.discard(key)
                    inline = True
        if inline:
            self._remove_quietly(key)

    def pending(self, key: str) -> bool:
        with self._cond:
            return key in self._pending

    def wait_gone(self, key: str, timeout: float | None = None) -> bool:
        """Block until no removal of `key` is queued or running; False if the timeout passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: key not in self._pending, timeout)

    def close(self) -> None:
        """Finish every queued removal, then stop the thread; later submits remove inline."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _run(self) -> None:
        while True:
            key = self._queue.get()
            if key is None:
                return
            try:
                self._remove_quietly(key)
            finally:
                with self._cond:
                    self._pending.discard(key)
                    self._cond.notify_all()

    def _remove_quietly(self, key: str) -> None:
        with contextlib.suppress(Exception):  # idempotent; an unreachable podman is not fatal here
            self._remove(key)
