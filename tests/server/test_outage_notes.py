"""A database outage is one log line when it begins and one when it ends, however many loop steps
and API calls fail meanwhile (the clock is the test's)."""

from __future__ import annotations

import logging

import pytest
from sqlalchemy.exc import OperationalError

from computepool.server.outage import OutageNotes


def test_an_outage_is_one_line_at_each_end(caplog: pytest.LogCaptureFixture) -> None:
    t = [100.0]
    notes = OutageNotes(clock=lambda: t[0])
    down = OperationalError("SELECT 1", {}, Exception("connection refused\\nmore"))
    caplog.set_level(logging.WARNING, "computepool.server")
    notes.answered()  # nothing was wrong: nothing said
    for i in range(50):
        notes.failed("the scheduler loop" if i % 2 else "GET /api/v1/allocations", down)
        t[0] += 0.2
    notes.answered()  # a step that worked, but failures came within the last second: still down
    t[0] += 1.0
    notes.answered()
    notes.answered()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith(
        "database unavailable (OperationalError, first seen by GET /api/v1/allocations)"
    )
    assert lines[1] == "database answers again after 11.0 s (50 calls and steps failed meanwhile)"
    notes.failed("the ledger loop", down)  # a new outage: said again
    assert len(caplog.records) == 3 and "first seen by the ledger loop" in caplog.records[-1].getMessage()
