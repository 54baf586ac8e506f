"""Blobs and file requests over the real app (SQLite and PostgreSQL): caps, hashes, tenants apart,
requests naming blobs, the agent's side of a file request, replicas and their blob dir, uploads
racing each other, and worker tokens forgotten when their allocation ends."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import Api, PgServer, TestClient
from sqlalchemy import update
from test_allocations import A, alloc, cycle, get, join, manual
from test_functions_api import join as join_with_python
from test_functions_api import register, report, submit, worker_tokens
from test_server_process import start_server_process, stop_server_process

from computepool.server import ServerSettings, create_app
from computepool.server.logic.function_workers import sweep as sweep_workers
from computepool.store import blobs as store
from computepool.store.db import db_now
from computepool.store.models import FileRequest

B = "/api/v1/blobs"
MIB = 1 << 20


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put(api: Api, data: bytes, headers: dict[str, str], digest: str | None = None) -> Any:
    return api.put(f"{B}/{digest or sha(data)}", content=data, headers=headers)


def blob_rows(api: Api) -> list[tuple[Any, ...]]:
    with api.app.state.db.read() as s:
        return [
            tuple(r)
            for r in s.connection().exec_driver_sql("SELECT tenant_id, sha256, size FROM blobs").all()
        ]


def test_upload_head_get_and_tenants_apart(api: Api) -> None:
    api.tenant("ta")
    api.tenant("tb")
    a = api.user("alice", "ta", "member")
    b = api.user("bob", "tb", "member")
    viewer = api.user("vic", "ta", "viewer")
    data = os.urandom(200_000)
    r = put(api, data, a)
    assert r.status_code == 201, r.text
    assert r.json()["created"] is True and r.json()["size"] == len(data)
    again = put(api, data, a)
    assert again.status_code == 200 and again.json()["created"] is False
    assert api.head(f"{B}/{sha(data)}", headers=a).status_code == 200
    got = api.get(f"{B}/{sha(data)}", headers=a)
    assert got.status_code == 200 and got.content == data
    # another tenant: the same 404 as bytes nobody holds, for HEAD and GET
    missing = sha(b"nobody has these")
    assert api.head(f"{B}/{sha(data)}", headers=b).status_code == 404
    denied = api.get(f"{B}/{sha(data)}", headers=b)
    absent = api.get(f"{B}/{missing}", headers=b)
    assert denied.status_code == absent.status_code == 404
    assert denied.json()["error"].replace(sha(data), "X") == absent.json()["error"].replace(missing, "X")
    # the same bytes uploaded by tb: stored once, counted for each tenant
    assert put(api, data, b).status_code == 201
    rows = blob_rows(api)
    assert len(rows) == 2 and {r[1] for r in rows} == {sha(data)}
    assert len(list((api.settings.blobs_path / "sha256").rglob("*"))) == 2  # one dir + one file
    # an admin may read any blob, but HEAD asks whether the admin's own tenant holds it (before an upload)
    assert api.get(f"{B}/{sha(data)}", headers=api.admin).content == data
    assert api.head(f"{B}/{sha(data)}", headers=api.admin).status_code == 404
    # a viewer reads, but may not upload
    assert api.get(f"{B}/{sha(data)}", headers=viewer).status_code == 200
    assert put(api, b"x", viewer).status_code == 403
    # the upload is audited with its size
    audit = api.ok("GET", "/api/v1/audit", params={"action": "blob.put"})["items"]
    assert any(e["detail"].get("size") == len(data) and e["actor"] == "user:alice" for e in audit)


def test_bad_uploads_are_refused_and_nothing_kept(make_api: Any) -> None:
    api = make_api(blob_max_mib=1, tenant_blob_max_mib=2)
    api.tenant("ta")
    a = api.user("alice", "ta", "member")
    # hash mismatch: 400 naming sha256
    r = put(api, b"hello", a, digest=sha(b"other"))
    assert r.status_code == 400 and r.json()["field"] == "sha256", r.text
    # not a sha256 at all: 422
    r = api.put(f"{B}/not-a-hash", content=b"x", headers=a)
    assert r.status_code == 422 and r.json()["field"] == "sha256"
    # over the per-upload cap: 413 with both sizes; also when the length is not declared (chunked)
    big = os.urandom(MIB + 10)
    r = put(api, big, a)
    assert r.status_code == 413 and "1.0 MiB" in r.json()["error"] and "--blob-max-mib" in r.json()["error"]

    def chunks() -> Any:
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    r = api.put(f"{B}/{sha(big)}", content=chunks(), headers=a)
    assert r.status_code == 413, r.text
    # the tenant cap: two 0.9 MiB blobs fit, a third does not
    for i in range(2):
        assert put(api, bytes([i]) * (900 * 1024), a).status_code == 201
    r = put(api, b"\x07" * (900 * 1024), a)
    assert r.status_code == 413 and "tenant ta holds 1.8 MiB" in r.json()["error"], r.text
    assert len(blob_rows(api)) == 2
    assert list((api.settings.blobs_path / "tmp").iterdir()) == []  # no temp left behind
    # no credential: 401
    assert api.put(f"{B}/{sha(b'x')}", content=b"x").status_code == 401


def test_requests_name_only_blobs_of_their_tenant(api: Api) -> None:
    manual(api)
    api.tenant("ta")
    api.tenant("tb")
    a = api.user("alice", "ta", "member")
    b = api.user("bob", "tb", "member")
    code = os.urandom(1000)
    assert put(api, code, a).status_code == 201
    r = api.post(A, json={"command": ["true"], "code": sha(code)}, headers=b)
    assert r.status_code == 422 and r.json()["field"] == "code" and "not found" in r.json()["error"]
    r = api.post(A, json={"command": ["true"], "stdin": sha(code)}, headers=b)
    assert r.status_code == 422 and r.json()["field"] == "stdin"
    r = api.post(A, json={"command": ["true"], "code": "zz"}, headers=a)
    assert r.status_code == 422 and r.json()["field"] == "code"
    before = api.ok("GET", A, params={"tenant": "ta"})["items"]
    assert before == []  # nothing was created by the refusals
    n1 = join(api, "n1", devices=1)
    made = alloc(api, a, command=["cat"], code=sha(code), stdin=sha(code), cpu_milli=100)
    assert made["request"]["code"] == sha(code) and made["request"]["stdin"] == sha(code)
    cycle(api)
    [asg] = api.ok("GET", "/api/v1/nodes/n1/assignments", headers=n1)["assignments"]
    assert asg["code"] == sha(code) and asg["stdin"] == sha(code)
    # the node running it may read the blob; another node may not
    n2 = join(api, "n2", devices=1)
    assert api.get(f"{B}/{sha(code)}", headers=n1).content == code
    assert api.get(f"{B}/{sha(code)}", headers=n2).status_code == 404


def test_file_requests_answered_by_the_node(make_api: Any) -> None:
    api = make_api(blob_max_mib=1)
    manual(api)
    api.tenant("ta")
    api.tenant("tb")
    a = api.user("alice", "ta", "member")
    b = api.user("bob", "tb", "member")
    n1 = join(api, "n1", devices=1)
    job = alloc(api, a, command=["sleep", "1"], cpu_milli=100)
    plain = alloc(api, a, cpu_milli=100)
    F = f"{A}/{job['id']}/files"
    # before it is bound there is no node to ask
    assert api.post(F, json={"path": "out"}, headers=a).status_code == 409
    cycle(api)
    assert get(api, job["id"])["state"] == "bound"
    # bad input: 4xx naming the field
    for body, field in (({"path": "/etc/passwd"}, "path"), ({"path": "a/../../x"}, "path"),
                        ({"path": ""}, "path"), ({"path": "x", "rank": 1}, "rank"),
                        ({"path": "x", "extra": 1}, "extra")):  # fmt: skip
        r = api.post(F, json=body, headers=a)
        assert r.status_code == 422 and r.json()["field"] == field, (body, r.text)
    assert api.post(f"{A}/{plain['id']}/files", json={"path": "x"}, headers=a).status_code == 409
    # another tenant's allocation answers exactly like a missing one
    other = api.post(F, json={"path": "out"}, headers=b)
    missing = api.post(f"{A}/999999/files", json={"path": "out"}, headers=b)
    assert other.status_code == missing.status_code == 404
    req = api.ok("POST", F, json={"path": "out/result.txt"}, headers=a)
    assert req["state"] == "pending" and req["node"] == "n1" and req["rank"] == 0
    pending = api.ok("GET", "/api/v1/nodes/n1/assignments", headers=n1)["files"]
    assert [(p["id"], p["path"], p["tenant"]) for p in pending] == [(req["id"], "out/result.txt", "ta")]
    assert api.get(f"{F}/{req['id']}", headers=b).status_code == 404
    # only the node asked may answer
    n2 = join(api, "n2", devices=1)
    assert api.put(f"/api/v1/nodes/n1/files/{req['id']}", content=b"x", headers=n2).status_code == 403
    assert api.put(f"/api/v1/nodes/n1/files/{req['id']}", content=b"x", headers=a).status_code == 403
    packed = os.urandom(5000)
    done = api.ok("PUT", f"/api/v1/nodes/n1/files/{req['id']}", content=packed, headers=n1)
    assert done["state"] == "done" and done["blob"] == sha(packed) and done["size"] == len(packed)
    seen = api.ok("GET", f"{F}/{req['id']}", headers=a, params={"wait": 1})
    assert seen["state"] == "done" and api.get(f"{B}/{sha(packed)}", headers=a).content == packed
    assert api.get(f"{B}/{sha(packed)}", headers=b).status_code == 404
    assert api.put(f"/api/v1/nodes/n1/files/{req['id']}", content=b"y", headers=n1).status_code == 409
    assert api.ok("GET", "/api/v1/nodes/n1/assignments", headers=n1)["files"] == []
    # a failure is kept with its reason; an answer over the cap fails the request, 413 nowhere else
    req2 = api.ok("POST", F, json={"path": "nope"}, headers=a)
    r = api.ok(
        "POST", f"/api/v1/nodes/n1/files/{req2['id']}/failed", json={"error": "no such file"}, headers=n1
    )
    assert r["state"] == "failed" and api.ok("GET", f"{F}/{req2['id']}", headers=a)["error"] == "no such file"
    req3 = api.ok("POST", F, json={"path": "big"}, headers=a)
    r = api.put(f"/api/v1/nodes/n1/files/{req3['id']}", content=os.urandom(MIB + 1), headers=n1)
    assert r.status_code == 200 and r.json()["state"] == "failed" and "cap" in r.json()["error"]


def test_sweep_forgets_old_unreferenced_blobs(api: Api) -> None:
    manual(api)
    api.tenant("ta")
    a = api.user("alice", "ta", "member")
    old, named = os.urandom(100), os.urandom(100)
    for data in (old, named):
        assert put(api, data, a).status_code == 201
    join(api, "n1", devices=1)
    alloc(api, a, command=["true"], code=sha(named), cpu_milli=100)  # pending: still live
    blob_dir = api.settings.blobs_path
    with api.app.state.db.write() as s:
        now = db_now(s)
        assert store.sweep(s, blob_dir, timedelta(days=1), now) == 0  # both were used just now
        assert store.sweep(s, blob_dir, timedelta(days=1), now + timedelta(days=2)) == 1
    assert [r[1] for r in blob_rows(api)] == [sha(named)]
    assert not store.blob_path(blob_dir, sha(old)).exists()
    assert store.blob_path(blob_dir, sha(named)).read_bytes() == named


# --- replicas -----------------------------------------------------------------------------------
@pytest.fixture
def replica(db_url: str, tmp_path: Path) -> Iterator[Callable[..., Api]]:
    """Control-plane replicas on one database, each with its own data dir (the first made the admin)."""
    clients: list[TestClient] = []
    admin: list[str] = []

    def make(name: str, **overrides: Any) -> Api:
        key = tmp_path / "audit-key"  # replicas share the key that seals the audit head
        settings = ServerSettings(data_dir=tmp_path / name, db_url=db_url, audit_key_file=key, **overrides)
        if admin:
            settings.data_dir.mkdir(parents=True)
            settings.admin_token_path.write_text(admin[0])
        app = create_app(settings)
        client = TestClient(app, raise_server_exceptions=False)
        client.__enter__()
        clients.append(client)
        admin.append(settings.admin_token_path.read_text())
        return Api(app, client, settings)

    yield make
    for c in reversed(clients):
        c.__exit__(None, None, None)


def test_replicas_share_one_blob_dir_or_say_why_not(replica: Callable[..., Api], tmp_path: Path) -> None:
    shared = tmp_path / "nfs" / "blobs"
    a = replica("a", blob_dir=shared)
    b = replica("b", blob_dir=shared)
    lone = replica("c")  # its own DATA_DIR/blobs: the misconfiguration
    a.tenant("ta")
    alice = a.user("alice", "ta", "member")
    data = os.urandom(50_000)
    assert put(a, data, alice).status_code == 201
    assert store.blob_path(shared, sha(data)).read_bytes() == data
    assert b.head(f"{B}/{sha(data)}", headers=alice).status_code == 200
    assert b.get(f"{B}/{sha(data)}", headers=alice).content == data
    # a replica whose blob dir lacks the bytes says what is wrong; HEAD says 404, so clients re-send
    r = lone.get(f"{B}/{sha(data)}", headers=alice)
    assert r.status_code == 404 and "not on this replica" in r.json()["error"], r.text
    assert "--blob-dir" in r.json()["error"]
    assert lone.head(f"{B}/{sha(data)}", headers=alice).status_code == 404
    # a wrong body is refused, and then the right bytes sent again are kept there (held: 200, counted once)
    assert put(lone, b"other bytes", alice, digest=sha(data)).status_code == 400
    assert not store.blob_path(lone.settings.blobs_path, sha(data)).exists()
    again = put(lone, data, alice)
    assert again.status_code == 200 and again.json()["tenant_bytes"] == len(data), again.text
    assert store.blob_path(lone.settings.blobs_path, sha(data)).read_bytes() == data
    assert lone.get(f"{B}/{sha(data)}", headers=alice).content == data
    # another tenant still gets the plain 404 (nothing says the bytes exist)
    a.tenant("tb")
    bob = a.user("bob", "tb", "member")
    r = b.get(f"{B}/{sha(data)}", headers=bob)
    assert r.status_code == 404 and "replica" not in r.json()["error"]


def test_two_server_processes_with_one_blob_dir(postgres: PgServer, tmp_path: Path) -> None:
    """`cpool server --blob-dir` as an operator runs two replicas on one PostgreSQL."""
    url = postgres.new_database()
    shared = tmp_path / "shared-blobs"
    common = ("--blob-dir", str(shared), "--audit-key-file", str(tmp_path / "audit-key"))
    procs: list[Any] = []
    try:
        for name in ("a", "b"):
            procs.append(start_server_process(tmp_path / name, url, tmp_path / f"{name}.log", *common))
        (_, base_a), (_, base_b) = procs
        admin = {"Authorization": "Bearer " + (tmp_path / "a" / "admin-token").read_text().strip()}
        data = os.urandom(70_000)
        r = httpx.put(f"{base_a}{B}/{sha(data)}", content=data, headers=admin, timeout=15)
        assert r.status_code == 201, r.text
        assert store.blob_path(shared, sha(data)).read_bytes() == data
        assert httpx.get(f"{base_b}{B}/{sha(data)}", headers=admin, timeout=15).content == data
    finally:
        for proc, _ in procs:
            stop_server_process(proc)


# --- uploads racing each other ------------------------------------------------------------------
def _at_once(calls: list[Callable[[], Any]]) -> list[Any]:
    out: list[Any] = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def run(i: int) -> None:
        start.wait()
        out[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return out


def test_the_same_bytes_sent_at_once_are_one_blob(api: Api) -> None:
    api.tenant("ta")
    a = api.user("alice", "ta", "member")
    for _ in range(4):  # the same bytes sent four times at once: one 201, three 200, never 409
        data = os.urandom(2 * MIB)
        codes = sorted(r.status_code for r in _at_once([partial(put, api, data, a)] * 4))
        assert codes == [200, 200, 200, 201], codes
    assert len(blob_rows(api)) == 4


def test_uploads_at_once_stay_under_the_tenant_cap(make_api: Any) -> None:
    api = make_api(blob_max_mib=8, tenant_blob_max_mib=10)
    api.tenant("ta")
    a = api.user("alice", "ta", "member")
    for _ in range(3):  # six different 4 MiB blobs at once against a 10 MiB cap: two fit, four are 413
        datas = [os.urandom(4 * MIB) for _ in range(6)]
        answers = _at_once([partial(put, api, d, a) for d in datas])
        codes = sorted(r.status_code for r in answers)
        assert codes == [201, 201, 413, 413, 413, 413], codes
        assert sum(r[2] for r in blob_rows(api)) == 8 * MIB
        refused = next(r for r in answers if r.status_code == 413)
        assert "tenant ta holds 8.0 MiB" in refused.json()["error"] and "10.0 MiB" in refused.json()["error"]
        with api.app.state.db.write() as s:  # room again for the next round
            s.connection().exec_driver_sql("DELETE FROM blobs")


# --- the sweep and functions --------------------------------------------------------------------
def test_sweep_keeps_the_code_of_functions_not_deleted(api: Api) -> None:
    manual(api)
    api.tenant("ta")
    a = api.user("alice", "ta", "member")
    join_with_python(api, "n1", ["3.11"], devices=0)
    code = os.urandom(300)
    assert put(api, code, a).status_code == 201
    fn = register(
        api, headers=a, request={"cpu_milli": 100, "command": ["python3", "w.py"], "code": sha(code)}
    )
    later = timedelta(days=2)
    with api.app.state.db.write() as s:  # idle for two days, no live allocation: kept for the function
        assert store.sweep(s, api.settings.blobs_path, timedelta(days=1), db_now(s) + later) == 0
    assert api.head(f"{B}/{sha(code)}", headers=a).status_code == 200
    assert api.request("DELETE", f"/api/v1/functions/{fn['id']}", headers=a).status_code == 200
    with api.app.state.db.write() as s:
        assert store.sweep(s, api.settings.blobs_path, timedelta(days=1), db_now(s) + later) == 1
    assert not store.blob_path(api.settings.blobs_path, sha(code)).exists()


# --- worker tokens ------------------------------------------------------------------------------
def _stored(api: Api, alloc_id: int) -> str:
    """The allocation's env and request as the database holds them (what sqlite3 or psql shows)."""
    with api.app.state.db.read() as s:
        row = (
            s.connection()
            .exec_driver_sql(f"SELECT env, request FROM allocations WHERE id = {alloc_id}")
            .one()
        )
    return f"{row[0]} {row[1]}"


def test_worker_tokens_leave_the_database_when_workers_end(api: Api) -> None:
    manual(api)
    n1 = join_with_python(api, "n1", ["3.11"], devices=0)
    fid = register(api, keep_warm_s=30, max_workers=1)["id"]
    [first, second] = submit(api, fid, b"a", b"b")
    cycle(api)
    [(w1, t1)] = worker_tokens(api, "n1", n1).items()
    secret = t1.split(".", 1)[1]
    assert secret in _stored(api, w1)  # a live worker's token is stored: its assignment carries it
    # ended by its node's report (the agent path)
    report(api, "n1", n1, w1, state="exited", exit_code=0)
    assert api.ok("GET", f"{A}/{w1}")["state"] == "released"
    assert secret not in _stored(api, w1) and "CPOOL_WORKER_TOKEN" not in _stored(api, w1)
    assert "CPOOL_FUNCTION_ID" in _stored(api, w1)  # the rest of the env stays
    # ended by a cancel (the API path)
    sweep_workers(api.app.state.db)
    cycle(api)
    [(w2, t2)] = worker_tokens(api, "n1", n1).items()
    assert t2.split(".", 1)[1] in _stored(api, w2)
    assert api.post(f"{A}/{w2}/cancel", headers=api.admin).status_code == 200
    assert t2.split(".", 1)[1] not in _stored(api, w2)
    assert second > first


# --- file requests: writers only, a few at a time ---------------------------------------------
def test_file_requests_are_for_writers_and_capped_per_tenant(api: Api) -> None:
    manual(api)
    api.tenant("ta")
    a = api.user("alice", "ta", "member")
    viewer = api.user("vic", "ta", "viewer")
    join(api, "n1", devices=1)
    job = alloc(api, a, command=["sleep", "100"], cpu_milli=100)
    cycle(api)
    F = f"{A}/{job['id']}/files"
    r = api.post(F, json={"path": "out"}, headers=viewer)
    assert r.status_code == 403, r.text
    from computepool.server.logic.blobs import MAX_PENDING_FILES

    asked = [api.ok("POST", F, json={"path": f"out{i}"}, headers=a)["id"] for i in range(MAX_PENDING_FILES)]
    r = api.post(F, json={"path": "one-more"}, headers=a)
    assert r.status_code == 429 and f"{MAX_PENDING_FILES} file requests pending" in r.json()["error"], r.text
    assert "tenant ta" in r.json()["error"]
    # requests no node answered for long are failed with why, which makes room again
    with api.app.state.db.write() as s:
        long_ago = db_now(s) - timedelta(hours=1)
        s.execute(update(FileRequest).where(FileRequest.id == asked[0]).values(created_at=long_ago))
    assert api.ok("POST", F, json={"path": "one-more"}, headers=a)["state"] == "pending"
    old = api.ok("GET", f"{F}/{asked[0]}", headers=a)
    assert old["state"] == "failed" and "no answer from the node" in old["error"]
