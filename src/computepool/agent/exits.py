"""Waking the agent's loop the moment a job's leader ends, instead of at its next pass.

Each watched leader gets a pidfd (Linux 5.3+), which becomes readable when that very process
ends, even when its pid is reused right after or it is not the agent's child (a re-adopted job).
One thread waits on all of them at once (epoll through `selectors`) and calls `on_exit`; the loop
then reaps and reports as it always does. Where pidfds are missing, the loop's own passes still
notice every end, only later.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import threading
from collections.abc import Callable

log = logging.getLogger("computepool.agent")


class ExitWatch:
    """Calls `on_exit()` from its own thread whenever a watched process ends (a hint: the caller
    checks which). `watch` a process right after it starts; `unwatch` once its end was handled."""

    def __init__(self, on_exit: Callable[[], None]) -> None:
        self.on_exit = on_exit
        self._sel = selectors.DefaultSelector()
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()  # tells the thread to stop
        os.set_blocking(self._wake_w, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="cpool-exits", daemon=True)
        self._thread.start()

    def watch(self, key: str, pid: int) -> bool:
        """Watch `pid` for `key` (the job the caller made sure it is); False where pidfds are missing.
        A process that is gone already wakes the loop at once."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.on_exit()
            return True
        except (AttributeError, OSError) as e:
            log.debug("no pidfd for %s (pid %d): %s; its end is seen at the next pass", key, pid, e)
            return False
        with self._lock:
            if self._closed:
                os.close(fd)
                return False
            old = self._fds.pop(key, None)
            if old is not None:
                self._drop(old)
            self._fds[key] = fd
            self._sel.register(fd, selectors.EVENT_READ, key)
        return True

    def unwatch(self, key: str) -> None:
        with self._lock:
            fd = self._fds.pop(key, None)
            if fd is not None:
                self._drop(fd)

    def watching(self) -> set[str]:
        with self._lock:
            return set(self._fds)

    def _drop(self, fd: int) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(fd)
        os.close(fd)

    def _run(self) -> None:
        while True:
            events = self._sel.select()
            ended = False
            with self._lock:
                if self._closed:
                    return
                for sel_key, _ in events:
                    key = sel_key.data
                    if key is None:
                        continue
                    # stays readable once ended: dropped here so that it wakes the loop once
                    if self._fds.get(key) == sel_key.fd:
                        del self._fds[key]
                        self._drop(sel_key.fd)
                    ended = True
            if ended:
                self.on_exit()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        self._thread.join(timeout=5.0)
        with self._lock:
            for fd in self._fds.values():
                self._drop(fd)
            self._fds.clear()
            self._sel.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
