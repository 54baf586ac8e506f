"""Verifying the audit chain while records are appended reports no break (PostgreSQL, where each
statement of the check sees the latest commits): a server starting beside a busy replica logged
"AUDIT CHAIN NOT INTACT: records cut from the end: head says seq 809, table ends at 808" and fired
the audit-chain-broken alert, though nothing was cut."""

from __future__ import annotations

from typing import Any

import pytest
from harness import Api
from sqlalchemy import event

from computepool.store import audit
from computepool.store.db import db_now

pytestmark = pytest.mark.parametrize("backend", ["postgresql"])


def _verify_with_an_append(api: Api, after_records: bool) -> audit.ChainReport:
    """Verify, with one record appended (and committed by another transaction) just before the
    check reads the records (`after_records` False) or just after it has read them."""
    db = api.app.state.db
    seen: list[str] = []
    done: list[bool] = []

    def append_now(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "audit_records" not in statement and "audit_head" not in statement:
            return
        if "FOR UPDATE" in statement.upper() or "INSERT" in statement.upper() or "UPDATE audit" in statement:
            return  # the append's own statements
        reads_records = "FROM audit_records" in statement and "max(" not in statement
        if not done and (reads_records if not after_records else "audit_records" in seen):
            done.append(True)
            with db.write() as w:
                audit.append(w, audit.AuditEvent("test", "test.append", "x", "ok", "r1"), db_now(w))
        seen.append("audit_records" if reads_records else "other")

    with db.read() as s:
        event.listen(db.engine, "before_cursor_execute", append_now)
        try:
            report = audit.verify(s)
        finally:
            event.remove(db.engine, "before_cursor_execute", append_now)
    assert done, f"no append happened (statements seen: {seen})"
    return report


def test_a_record_appended_after_the_records_were_read_is_no_cut(api: Api) -> None:
    api.tenant("t1")  # a few records
    report = _verify_with_an_append(api, after_records=True)
    assert report.ok, report.cause


def test_a_record_appended_before_the_records_are_read_is_no_break(api: Api) -> None:
    api.tenant("t1")
    report = _verify_with_an_append(api, after_records=False)
    assert report.ok, report.cause
