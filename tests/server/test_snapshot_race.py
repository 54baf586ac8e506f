"""A job that changes state between the scheduling snapshot's two reads stays in the snapshot.

On PostgreSQL each statement of the snapshot's read sees the latest commits. The cycle lists the
live allocations, then reads in full those that changed since its last cycle: a job bound by that
cycle and reported running by its agent in between (tens of milliseconds after the bind, as
happens all the time) was left out, so the next request got the device share it holds (the chaos
run's over-committed devices)."""

from __future__ import annotations

from typing import Any

import pytest
from harness import Api
from sqlalchemy import event, text
from test_allocations import alloc, cycle, get, join, manual

pytestmark = pytest.mark.parametrize("backend", ["postgresql"])


def test_a_job_turning_active_between_the_reads_keeps_its_share(make_api: Any) -> None:
    api: Api = make_api()
    manual(api)
    join(api, "n1", devices=1)
    first = alloc(api, gpus=1, gpu_milli=500, command=["sleep", "100"])
    assert cycle(api).leader
    assert get(api, first["id"])["state"] == "bound"
    waiting = [alloc(api, gpus=1, gpu_milli=500, command=["sleep", "100"]) for _ in range(2)]
    engine = api.app.state.db.engine
    done: list[bool] = []

    def report_running(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        """Just before the second read: the agent's report commits on another connection."""
        by_id = "allocations.id IN" in statement or "allocations.id = ANY" in statement
        if done or "allocations.bound_at" not in statement or not by_id:
            return
        done.append(True)
        with engine.connect() as other:
            other.execute(text("UPDATE allocations SET state = 'active' WHERE id = :i"), {"i": first["id"]})
            other.commit()

    event.listen(engine, "before_cursor_execute", report_running)
    try:
        cycle(api)
    finally:
        event.remove(engine, "before_cursor_execute", report_running)
    assert done, "the second read was not seen"
    assert get(api, first["id"])["state"] == "active"
    states = sorted(get(api, w["id"])["state"] for w in waiting)
    assert states == ["bound", "pending"]  # one more half of the device, not two
