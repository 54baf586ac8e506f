"""Tamper evidence at the end of the audit chain: the sealed head and the server's anchor.

A chain alone verifies as intact after records are cut from its end, or after a tail is rewritten
together with the head row. These tests make exactly those edits, with SQL on the real database
(SQLite and PostgreSQL), and require the server to name what happened.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from harness import Api
from sqlalchemy import text
from test_server_process import _cpool, start_server_process, stop_server_process

from computepool.store import audit
from computepool.store.db import Database


def _changes(api: Api, n: int, prefix: str = "t") -> None:
    for i in range(n):
        api.tenant(f"{prefix}{i}")


def _head(db: Database) -> tuple[int, str, str | None]:
    with db.read() as s:
        return audit.read_head(s)


def _anchored(api: Api, seq: int) -> dict[str, object]:
    """Wait until the server's anchor file has reached `seq` (it is written once a second)."""
    path = api.settings.audit_anchor_path
    deadline = time.monotonic() + 10
    while True:
        if path.exists():
            doc = json.loads(path.read_text())
            if doc["seq"] >= seq:
                return dict(doc)
        assert time.monotonic() < deadline, f"anchor never reached seq {seq}"
        time.sleep(0.1)


def _cut_after(db: Database, seq: int, head: tuple[int, str, str | None]) -> None:
    """Remove the records after `seq` and set the head row to `head` (as an intruder would)."""
    with db.write() as s:
        s.execute(text("DELETE FROM audit_records WHERE seq > :seq"), {"seq": seq})
        s.execute(
            text("UPDATE audit_head SET seq = :seq, hash = :hash, mac = :mac WHERE id = 1"),
            {"seq": head[0], "hash": head[1], "mac": head[2]},
        )


def _verify(api: Api) -> dict[str, object]:
    return dict(api.ok("GET", "/api/v1/audit/verify"))


def test_key_and_anchor_are_private_and_the_head_is_sealed(api: Api) -> None:
    _changes(api, 3)
    key_path = api.settings.audit_key_path
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    seq, head_hash, mac = _head(api.app.state.db)
    assert seq == 4 and mac == audit.seal(bytes.fromhex(key_path.read_text().strip()), seq, head_hash)
    _anchored(api, seq)
    assert stat.S_IMODE(api.settings.audit_anchor_path.stat().st_mode) == 0o600
    assert _verify(api) == {"ok": True, "records": 4, "first_broken": None, "cause": None}
    ready = api.get("/readyz").json()
    assert ready["audit"] == "intact" and "audit_error" not in ready


def test_records_cut_with_the_head_edited_to_match(api: Api) -> None:
    _changes(api, 6)
    db: Database = api.app.state.db
    with db.read() as s:
        rec = s.get(audit.AuditRecord, 4)
        assert rec is not None
        new_head = (4, rec.hash, None)
    # without the key the intruder cannot seal the new head: a NULL or old seal does not match
    _cut_after(db, 4, new_head)
    rep = _verify(api)
    assert rep["ok"] is False and rep["records"] == 4
    assert (
        rep["cause"] == "head signature does not match: the head was changed without the server's audit key"
    )


def test_records_cut_back_to_an_old_sealed_head(api: Api) -> None:
    """A head saved earlier, seal and all, put back after cutting: only the anchor can tell."""
    _changes(api, 3)
    db: Database = api.app.state.db
    old = _head(db)
    _changes(api, 5, prefix="u")
    seq_now = _head(db)[0]
    _anchored(api, seq_now)
    _cut_after(db, old[0], old)
    rep = _verify(api)
    assert rep["ok"] is False and rep["first_broken"] == old[0] + 1
    assert (
        rep["cause"]
        == f"records cut from the end: the server's anchor says seq {seq_now}, table ends at {old[0]}"
    )
    # the server notices by itself within a second or two: /readyz and the metric say so
    deadline = time.monotonic() + 10
    while api.get("/readyz").json()["audit"] != "broken":
        assert time.monotonic() < deadline, "the running server did not notice the cut"
        time.sleep(0.1)
    assert "records cut from the end" in api.get("/readyz").json()["audit_error"]
    metrics = api.get("/metrics", headers=api.admin).text
    assert "cpool_audit_chain_intact 0.0" in metrics


def test_tail_rewritten_with_a_consistent_chain(api: Api) -> None:
    """The last records replaced by forged ones, hashes recomputed and the head moved to match."""
    _changes(api, 4)
    db: Database = api.app.state.db
    seq = _head(db)[0]
    _anchored(api, seq)
    with db.write() as s:
        recs = [s.get(audit.AuditRecord, k) for k in (seq - 1, seq)]
        prev = recs[0].prev_hash if recs[0] else ""
        for rec in recs:
            assert rec is not None
            rec.actor = "user:nobody"
            rec.prev_hash = prev
            rec.hash = prev = audit.record_hash(rec)
        s.execute(text("UPDATE audit_head SET hash = :h WHERE id = 1"), {"h": prev})
    rep = _verify(api)
    assert rep["ok"] is False
    assert (
        rep["cause"] == "head signature does not match: the head was changed without the server's audit key"
    )
    # with the seal out of the picture (an intruder who also read the key), the anchor still tells
    key = bytes.fromhex(api.settings.audit_key_path.read_text().strip())
    with db.write() as s:
        audit.reseal(s, key)
    rep = _verify(api)
    assert rep["cause"] == f"tail rewritten: record {seq} differs from the one the server anchored"


def test_an_edited_anchor_is_refused(api: Api) -> None:
    _changes(api, 2)
    doc = _anchored(api, _head(api.app.state.db)[0])
    api.settings.audit_anchor_path.write_text(json.dumps({**doc, "seq": int(str(doc["seq"])) - 1}))
    rep = _verify(api)
    assert rep["ok"] is False and "signature does not match" in str(rep["cause"])


def test_start_up_check_and_cli_name_the_cut(make_api: Callable[..., Api], tmp_path: Path) -> None:
    """A restarted server checks the whole chain at start, keeps serving, and says what is wrong;
    `cpool audit verify` exits 1 with the cause on one line."""
    api = make_api()
    _changes(api, 3)
    db: Database = api.app.state.db
    old = _head(db)
    _changes(api, 2, prefix="u")
    _anchored(api, _head(db)[0])
    _cut_after(db, old[0], old)
    again = make_api()  # a second server on the same data dir and database: the start-up check
    deadline = time.monotonic() + 10
    while (ready := again.get("/readyz").json())["audit"] != "broken":
        assert time.monotonic() < deadline, ready
        time.sleep(0.1)
    assert ready["status"] == "ready" and "records cut from the end" in ready["audit_error"]
    assert again.ok("GET", "/api/v1/tenants")["items"]  # still serving


def test_cli_audit_verify_exits_1_naming_the_cut(backend: str, db_url: str, tmp_path: Path) -> None:
    """`cpool audit verify` against a real server process: exit 1, one line with the cause."""
    data_dir = tmp_path / "home"
    proc, base = start_server_process(data_dir, None if backend == "sqlite" else db_url, tmp_path / "log")
    try:
        token = (data_dir / "admin-token").read_text().strip()
        env = {**os.environ, "CPOOL_SERVER": base, "CPOOL_TOKEN": token, "CPOOL_CONFIG": str(tmp_path / "c")}
        cli = [*_cpool(), "audit", "verify"]
        for name in ("a", "b", "c"):
            r = httpx.post(
                f"{base}/api/v1/tenants", json={"name": name}, headers={"Authorization": f"Bearer {token}"}
            )
            assert r.status_code == 201
        ok = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=60)
        assert ok.returncode == 0 and "audit chain intact: 4 records" in ok.stdout
        db = Database(db_url if backend != "sqlite" else f"sqlite:///{data_dir / 'pool.db'}")
        try:
            with db.read() as s:
                rec = s.get(audit.AuditRecord, 2)
                assert rec is not None
                head = (2, rec.hash, None)
            deadline = time.monotonic() + 10
            while (
                not (data_dir / "audit-anchor").exists()
                or json.loads((data_dir / "audit-anchor").read_text())["seq"] < 4
            ):
                assert time.monotonic() < deadline
                time.sleep(0.1)
            _cut_after(db, 2, head)
        finally:
            db.dispose()
        bad = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=60)
        assert bad.returncode == 1, bad
        lines = bad.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in bad.stderr
        assert "audit chain not intact: head signature does not match" in lines[0]
    finally:
        stop_server_process(proc)
