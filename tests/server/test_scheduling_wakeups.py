"""Wake-ups of the scheduling loop are gathered: a burst of them is one cycle, those during a step
one more step, and a queue that cannot move is not decided again while nothing changes."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from harness import Api
from test_allocations import A, alloc, cycle, get, join, manual

from computepool.server.loops import Loops, Periodic

DEADLINE_S = 20.0


def _full_cycles(api: Api) -> float:
    """Cycles that decided (the cycle-duration histogram counts only those)."""
    text = api.get("/metrics", headers=api.admin).text
    line = next(x for x in text.splitlines() if x.startswith("cpool_scheduling_cycle_seconds_count"))
    return float(line.split()[-1])


def test_submissions_arriving_together_are_decided_by_fewer_cycles(api: Api) -> None:
    api.app.state.controller.settle_s = 0.5  # wide: the burst below lands well within it
    join(api, "n1", devices=1, cpu_milli=64000)
    before = _full_cycles(api)
    n = 8
    go = threading.Barrier(n)

    def submit(_: int) -> dict[str, Any]:
        go.wait(timeout=DEADLINE_S)
        return alloc(api, gpus=0, cpu_milli=100, memory_mib=64)

    with ThreadPoolExecutor(n) as pool:
        made = list(pool.map(submit, range(n)))
    deadline = time.monotonic() + DEADLINE_S
    while any(get(api, a["id"])["state"] == "pending" for a in made):
        assert time.monotonic() < deadline, "the scheduling loop did not bind the burst"
        time.sleep(0.05)
    cycles = _full_cycles(api) - before
    assert 1 <= cycles < n, cycles


def test_an_unchanged_queue_is_not_decided_again(api: Api) -> None:
    manual(api)
    join(api, "n1", devices=1)
    first = alloc(api, gpus=1)
    second = alloc(api, gpus=1)
    assert cycle(api).result.bound == [first["id"]]
    assert get(api, second["id"])["reason"] != "submitted"  # the cycle stored why it waits
    again = cycle(api)  # sees the reason it wrote: decided once more, nothing new
    assert not again.skipped and again.result.bound == [] and again.pending == 1
    idle = cycle(api)
    assert idle.skipped and idle.pending == 1 and idle.result.bound == []
    api.ok("POST", f"{A}/{first['id']}/release")  # a wake-up, and the device is free
    freed = cycle(api)
    assert not freed.skipped and freed.result.bound == [second["id"]]


def test_an_unchanged_queue_is_decided_again_after_refresh(api: Api) -> None:
    manual(api)
    api.app.state.controller.refresh_s = 0.0  # an unchanged snapshot stands for nothing
    join(api, "n1", devices=1)
    alloc(api, gpus=1)
    alloc(api, gpus=1)
    reports = [cycle(api) for _ in range(3)]
    assert [r.skipped for r in reports] == [False, False, False]


def test_a_node_that_goes_quiet_is_a_change(api: Api) -> None:
    from harness import heartbeat_ago

    manual(api)
    join(api, "n1", devices=1)
    join(api, "n2", devices=1)
    alloc(api, gpus=1)
    alloc(api, gpus=1)
    waiting = alloc(api, gpus=1)
    cycle(api)
    cycle(api)
    assert cycle(api).skipped
    heartbeat_ago(api, "n2", 3 * api.settings.heartbeat_interval_s)  # no wake-up: only the row says it
    seen = cycle(api)
    assert not seen.skipped and get(api, waiting["id"])["state"] == "pending"


def test_a_start_is_no_wake_up_but_an_end_is(api: Api) -> None:
    from test_allocations_agent import report

    manual(api)
    n1 = join(api, "n1", devices=1)
    job = alloc(api, gpus=0, cpu_milli=100, memory_mib=64, command=["true"])
    assert cycle(api).result.bound == [job["id"]]
    hub = api.app.state.hub
    wakes = hub.wakes
    report(api, "n1", n1, {"allocation_id": job["id"], "attempt": 1, "state": "running"})
    assert get(api, job["id"])["state"] == "active"
    assert hub.wakes == wakes  # nothing the scheduler decides tells bound from active
    report(api, "n1", n1, {"allocation_id": job["id"], "attempt": 1, "state": "exited", "exit_code": 0})
    assert get(api, job["id"])["state"] == "released"
    assert hub.wakes > wakes  # its capacity is free


def _loop_with(step: Any, settle_s: float) -> tuple[Loops, Periodic, asyncio.Event]:
    wake = asyncio.Event()
    p = Periodic("test", 3600.0, step, wake=lambda: wake, settle=lambda: settle_s)
    return Loops([p]), p, wake


def test_wake_ups_during_a_step_are_one_more_step() -> None:
    entered, release = threading.Event(), threading.Event()
    steps: list[int] = []

    def step() -> None:
        steps.append(1)
        entered.set()
        release.wait(DEADLINE_S)

    async def main() -> None:
        loops, _, wake = _loop_with(step, 0.0)
        loops.start()
        wake.set()
        await asyncio.to_thread(entered.wait, DEADLINE_S)
        for _ in range(5):  # five wake-ups while the step runs
            wake.set()
            await asyncio.sleep(0)
        entered.clear()
        release.set()
        await asyncio.to_thread(entered.wait, DEADLINE_S)
        for _ in range(50):  # a third step would come at once: give it every chance
            await asyncio.sleep(0.01)
        await loops.stop()

    asyncio.run(main())
    assert len(steps) == 2


def test_a_burst_of_wake_ups_is_one_step() -> None:
    stepped = threading.Event()
    steps: list[int] = []

    def step() -> None:
        steps.append(1)
        stepped.set()

    async def main() -> None:
        loops, _, wake = _loop_with(step, 0.3)
        loops.start()
        for _ in range(20):
            wake.set()
            await asyncio.sleep(0)
        await asyncio.to_thread(stepped.wait, DEADLINE_S)
        for _ in range(50):  # a second step would follow at once: give it every chance
            await asyncio.sleep(0.01)
        await loops.stop()

    asyncio.run(main())
    assert len(steps) == 1


def test_stop_ends_a_loop_that_waits() -> None:
    steps: list[int] = []

    async def main() -> None:
        loops, p, wake = _loop_with(lambda: steps.append(1), 3600.0)
        loops.start()
        wake.set()
        await asyncio.sleep(0.05)  # in the settle wait now (an hour): stop must not sit it out
        await asyncio.wait_for(loops.stop(), DEADLINE_S)
        assert p._task is None

    asyncio.run(main())
    assert steps == []
