"""In-process wake-ups: the scheduling loop and long-polls sleep until something they watch changes.

Services run in worker threads and call `notify`/`wake_scheduler`; waiters live on the app's
event loop. A wake-up is only a hint: waiters re-read the database, and long-polls re-check
every second, so a change made by another replica is seen within a second even without one.
"""

from __future__ import annotations

import asyncio
import contextlib


class Hub:
    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self.scheduler_event = asyncio.Event()
        self.wakes = 0  # wake_scheduler calls so far: a cycle that saw no new one may skip deciding

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the app's loop (in the lifespan); before that, notifications are dropped."""
        self._loop = loop
        self.scheduler_event = asyncio.Event()

    def _call(self, fn: object, *args: object) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop is shutting down
            loop.call_soon_threadsafe(fn, *args)  # type: ignore[arg-type]

    def wake_scheduler(self) -> None:
        self.wakes += 1  # from any thread: a lost increment between two racing callers still changes it
        self._call(self.scheduler_event.set)

    def notify(self, *keys: str) -> None:
        """Wake everyone waiting on any of `keys` (e.g. `node:n1`, `logs:42`); callable from any thread."""
        if keys:
            self._call(self._fire, keys)

    def _fire(self, keys: tuple[str, ...]) -> None:
        for k in keys:
            for ev in self._waiters.get(k, ()):
                ev.set()

    def subscribe(self, key: str) -> asyncio.Event:
        """On the loop: an event set by the next `notify(key)`. Subscribe before reading, then wait."""
        ev = asyncio.Event()
        self._waiters.setdefault(key, set()).add(ev)
        return ev

    def unsubscribe(self, key: str, ev: asyncio.Event) -> None:
        group = self._waiters.get(key)
        if group is not None:
            group.discard(ev)
            if not group:
                del self._waiters[key]
