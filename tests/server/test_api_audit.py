"""The audit chain: every change recorded, filters, verification, tampering found, concurrent writers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

from harness import Api
from sqlalchemy import text

from computepool.store import audit
from computepool.store.db import Database, db_now


def _changes(api: Api) -> None:
    api.tenant("a")
    api.ok("POST", "/api/v1/users", json={"name": "bob", "tenant": "a", "role": "member"})
    api.ok("POST", "/api/v1/tokens", json={"user": "bob"})
    api.ok("PUT", "/api/v1/tenants/a/quota", json={"gpu_milli": {"guaranteed": 1000, "limit": 2000}})
    api.join_node("n1")
    api.ok("POST", "/api/v1/nodes/n1/cordon")


def test_every_change_is_recorded_with_request_id(api: Api) -> None:
    _changes(api)
    r = api.post("/api/v1/tenants", json={"name": "b"}, headers={**api.admin, "X-Request-ID": "req-42"})
    assert r.headers["x-request-id"] == "req-42"
    items = api.ok("GET", "/api/v1/audit")["items"]
    actions = [i["action"] for i in items]
    assert actions == [
        "bootstrap",
        "tenant.create",
        "user.create",
        "token.create",
        "quota.set",
        "join-token.create",
        "node.join",
        "node.cordon",
        "tenant.create",
    ]
    assert items[-1]["request_id"] == "req-42" and items[-1]["actor"] == "user:admin"
    assert items[6]["actor"].startswith("join-token:")
    assert [i["seq"] for i in items] == list(range(1, len(items) + 1))
    assert all(items[k]["prev_hash"] == items[k - 1]["hash"] for k in range(1, len(items)))
    # filters
    assert [i["action"] for i in api.ok("GET", "/api/v1/audit?action=user.create")["items"]] == [
        "user.create"
    ]
    assert {i["tenant"] for i in api.ok("GET", "/api/v1/audit?tenant=a")["items"]} == {"a"}
    assert api.ok("GET", "/api/v1/audit?actor=user:nobody")["items"] == []
    future = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    assert api.ok("GET", "/api/v1/audit", params={"since": future})["items"] == []
    assert len(api.ok("GET", "/api/v1/audit", params={"until": future})["items"]) == len(items)
    assert len(api.ok("GET", "/api/v1/audit", params={"until": "2000-01-01T00:00:00"})["items"]) == 0


def test_refused_changes_are_recorded(api: Api) -> None:
    api.tenant("a")
    member = api.user("m", "a", "member")
    assert api.post("/api/v1/tenants", json={"name": "evil"}, headers=member).status_code == 403
    assert api.post("/api/v1/tenants", json={"name": "a"}, headers=api.admin).status_code == 409
    refused = [i for i in api.ok("GET", "/api/v1/audit")["items"] if i["outcome"].startswith("refused")]
    assert [(i["actor"], i["action"], i["outcome"]) for i in refused] == [
        ("user:m", "tenant.create", "refused:403"),
        ("user:admin", "tenant.create", "refused:409"),
    ]
    intact = {"ok": True, "records": 6, "first_broken": None, "cause": None}
    assert api.ok("GET", "/api/v1/audit/verify") == intact


def test_verify_finds_an_edited_row(api: Api) -> None:
    _changes(api)
    report = api.ok("GET", "/api/v1/audit/verify")
    assert report["ok"] and report["records"] == 8 and report["first_broken"] is None
    db: Database = api.app.state.db
    with db.write() as s:
        s.execute(text("UPDATE audit_records SET outcome = 'forged' WHERE seq = 4"))
    rep = api.ok("GET", "/api/v1/audit/verify")
    assert (rep["ok"], rep["records"], rep["first_broken"]) == (False, 3, 4)
    assert rep["cause"].startswith("broken at record 4: edited")
    # re-hashing the edited row moves the break to the next link
    with db.write() as s:
        rec = s.get(audit.AuditRecord, 4)
        assert rec is not None
        rec.hash = audit.record_hash(rec)
    assert api.ok("GET", "/api/v1/audit/verify")["first_broken"] == 5


def test_verify_finds_removed_rows(api: Api) -> None:
    _changes(api)
    db: Database = api.app.state.db
    with db.write() as s:
        s.execute(text("DELETE FROM audit_records WHERE seq = 8"))
    with db.read() as s:
        rep = audit.verify(s)
    assert (rep.ok, rep.first_broken) == (False, 8)
    with db.write() as s:
        s.execute(text("DELETE FROM audit_records WHERE seq = 2"))
    with db.read() as s:
        assert audit.verify(s).first_broken == 2


def test_concurrent_appends_keep_one_chain(api: Api) -> None:
    db: Database = api.app.state.db

    def append(k: int) -> None:
        for j in range(10):
            with db.write() as s:
                event = audit.AuditEvent(
                    actor=f"t{k}", action="test", target=f"x{j}", outcome="ok", request_id="r"
                )
                audit.append(s, event, db_now(s))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(append, range(8)))
    with db.read() as s:
        rep = audit.verify(s)
    assert rep.ok and rep.records == 81
