"""The control plane's background loops, in one shape: a `Periodic` names a step and how often it
runs; `Loops` starts them all, skips leader-only steps while this replica does not lead, keeps a
loop alive through a failed step, and on stop lets each step in flight finish before it returns
(a step in a worker thread may still be writing to the database the app is about to close).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import cast

from computepool.server.leadership import Leadership
from computepool.server.outage import DB_DOWN, OutageNotes

log = logging.getLogger("computepool.server")

STOP_GRACE_S = 30.0  # how long stop waits for the steps in flight before it cancels them
Step = Callable[[], object]


@dataclass
class Periodic:
    """`step()` every `every_s` seconds (a plain function runs in a worker thread, a coroutine
    function on the loop). `wake` ends a wait early (the scheduler's hub event); after a wake-up
    the loop waits `settle()` seconds more, so a burst of wake-ups (many submissions, many agent
    reports) is one step, and wake-ups during a step are one more step, not one each. `enabled`
    is read before each step (tests turn a loop off and drive its step themselves). Steps that
    judge time take it from the database's clock, which every replica shares; their passes take
    `now` too, for tests."""

    name: str
    every_s: float
    step: Step
    leader_only: bool = False
    wake: Callable[[], asyncio.Event] | None = None
    enabled: Callable[[], bool] = lambda: True
    quiet: bool = False  # a failed step is logged at debug level (expected while the database is away)
    first_at_start: bool = False  # run once right away instead of after the first wait
    settle: Callable[[], float] = lambda: 0.0  # seconds to gather more wake-ups after the first
    _task: asyncio.Task[None] | None = field(default=None, init=False, repr=False)
    _waiting: bool = field(default=False, init=False, repr=False)


class Loops:
    """Every background loop of one server process, started and stopped together."""

    def __init__(
        self, loops: list[Periodic], leadership: Leadership | None = None, outage: OutageNotes | None = None
    ) -> None:
        if leadership is None and any(p.leader_only for p in loops):
            raise ValueError("leader-only loops need the process's Leadership")
        self.leadership = leadership
        self.outage = outage or OutageNotes()
        self.loops = loops
        self._stopping = asyncio.Event()

    def start(self) -> None:
        self._stopping = asyncio.Event()
        running = asyncio.get_running_loop()
        for p in self.loops:
            p._task = running.create_task(self._run(p), name=f"cpool-{p.name}")

    async def stop(self) -> None:
        """Stop waiting, let each step in flight finish (up to STOP_GRACE_S), then return."""
        self._stopping.set()
        for p in self.loops:
            if p._task is not None and p._waiting:
                p._task.cancel()  # between steps: nothing to finish
        tasks = [p._task for p in self.loops if p._task is not None]
        _, late = await asyncio.wait(tasks, timeout=STOP_GRACE_S) if tasks else (set(), set())
        for task in late:
            log.warning("loop %s did not stop within %.0f s: cancelled", task.get_name(), STOP_GRACE_S)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for p in self.loops:
            p._task = None

    async def _run(self, p: Periodic) -> None:
        first = p.first_at_start
        while not self._stopping.is_set():
            if not first:
                p._waiting = True
                try:
                    await self._wait(p)
                except asyncio.CancelledError:
                    if self._stopping.is_set():
                        return  # stop() ends a loop that waits
                    raise
                finally:
                    p._waiting = False
            first = False
            if self._stopping.is_set():
                return
            if p.enabled() and self._may_lead(p):
                await self.run_step(p)

    def _may_lead(self, p: Periodic) -> bool:
        return not p.leader_only or (self.leadership is not None and self.leadership.term is not None)

    async def run_step(self, p: Periodic) -> None:
        """One step, whose failure is logged and survived (the database away, a bug): the loop goes on."""
        try:
            if inspect.iscoroutinefunction(p.step):
                await cast(Callable[[], Awaitable[object]], p.step)()
            else:
                await asyncio.to_thread(p.step)
        except DB_DOWN as e:  # the database away: one line per outage (outage.py), not a traceback
            self.outage.failed(f"the {p.name} loop", e)
            log.debug("%s: step failed", p.name, exc_info=True)
        except Exception:
            if p.quiet:
                log.debug("%s: step skipped", p.name, exc_info=True)
            else:
                log.exception("%s: step failed", p.name)
        else:
            self.outage.answered()

    @staticmethod
    async def _wait(p: Periodic) -> None:
        """`every_s`, or until `wake` (then `settle()` more). One timer per wait, no extra tasks:
        a dozen loops tick every second or so, and an idle server's CPU is mostly their waits."""
        if p.wake is None:
            await asyncio.sleep(p.every_s)
            return
        event = p.wake()
        if not event.is_set():
            try:
                async with asyncio.timeout(p.every_s):
                    await event.wait()
            except TimeoutError:
                return
        settle = p.settle()
        if settle > 0:
            await asyncio.sleep(settle)  # wake-ups meanwhile are served by the same step
        p.wake().clear()
