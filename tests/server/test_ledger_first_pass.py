"""A new pool's first ledger pass books what ran before it from its bind: a half-GPU job bound
before the pool's first pass, and one that ended before it, book share × bind-to-end, not only
the time after that pass."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from test_allocations import alloc, cycle, get, join, manual
from test_ledger import INTERVAL, backdate, job_usage, tick, when


def test_the_first_pass_books_from_the_bind(make_api: Any) -> None:
    api = make_api(ledger_interval_s=INTERVAL)
    api.app.state.accountant.auto = False
    manual(api)
    join(api, "n1", devices=2)
    running = alloc(api, name="running", gpus=1, gpu_milli=500)
    done = alloc(api, name="done", gpus=1, gpu_milli=500)
    cycle(api)
    b0 = datetime.now(UTC) - timedelta(seconds=100)
    backdate(api, running["id"], b0)  # bound 100 s before the pool's first pass
    backdate(api, done["id"], b0)
    api.ok("POST", f"/api/v1/allocations/{done['id']}/release")  # and ended before it
    ended = when(get(api, done["id"])["ended_at"])
    first = ended + timedelta(seconds=1)
    tick(api, first)  # the first pass ever
    assert job_usage(api, done["id"])["gpu_hours"] == pytest.approx(
        0.5 * (ended - b0).total_seconds() / 3600, abs=1e-6
    )
    assert job_usage(api, running["id"])["gpu_hours"] == pytest.approx(
        0.5 * (first - b0).total_seconds() / 3600, abs=1e-6
    )
    tick(api, first + timedelta(seconds=20))
    held = (first + timedelta(seconds=20) - b0).total_seconds()
    assert job_usage(api, running["id"])["gpu_hours"] == pytest.approx(0.5 * held / 3600, abs=1e-6)
