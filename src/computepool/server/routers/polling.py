"""The one long-poll of the API: read, and until the answer is ready or the wait is over, sleep
on the hub's topic for what is read (subscribed before reading, so no change falls between the
read and the wait), re-reading at least every RECHECK_S for changes made by another replica."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

from fastapi.concurrency import run_in_threadpool

from computepool.server.hub import Hub

RECHECK_S = 1.0  # long-polls re-read at least this often (changes made by other replicas)
T = TypeVar("T")


async def long_poll(
    hub: Hub,
    topic: str,
    wait_s: float,
    read: Callable[[], T],
    ready: Callable[[T], bool],
    settle_s: float = 0.0,
) -> T:
    """`read()` (in a worker thread) until `ready` says so or `wait_s` passes, woken by `topic`.

    `settle_s`: once woken, wait this long before reading, so that a poll over many things takes
    the changes that come close together in one answer instead of one answer each."""
    deadline = time.monotonic() + wait_s
    while True:
        ev = hub.subscribe(topic)
        try:
            out = await run_in_threadpool(read)
            left = deadline - time.monotonic()
            if ready(out) or left <= 0:
                return out
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ev.wait(), min(left, RECHECK_S))
            if ev.is_set() and settle_s:
                await asyncio.sleep(min(settle_s, max(0.0, deadline - time.monotonic())))
        finally:
            hub.unsubscribe(topic, ev)
