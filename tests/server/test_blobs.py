"""Blobs and file requests over the real app (SQLite and PostgreSQL): caps, hashes, tenants apart,
requests naming blobs, and the agent's side of a file request."""

from __future__ import annotations

import hashlib
import os
from typing import Any

from harness import Api
from test_allocations import A, alloc, cycle, get, join, manual

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
    assert len(list((api.settings.data_dir / "blobs" / "sha256").rglob("*"))) == 2  # one dir + one file
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
    assert list((api.settings.data_dir / "blobs" / "tmp").iterdir()) == []  # no temp left behind
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
    from datetime import timedelta

    from computepool.store import blobs as store
    from computepool.store.db import db_now

    manual(api)
    api.tenant("ta")
    a = api.user("alice", "ta", "member")
    old, named = os.urandom(100), os.urandom(100)
    for data in (old, named):
        assert put(api, data, a).status_code == 201
    join(api, "n1", devices=1)
    alloc(api, a, command=["true"], code=sha(named), cpu_milli=100)  # pending: still live
    data_dir = api.settings.data_dir
    with api.app.state.db.write() as s:
        now = db_now(s)
        assert store.sweep(s, data_dir, timedelta(days=1), now) == 0  # both were used just now
        assert store.sweep(s, data_dir, timedelta(days=1), now + timedelta(days=2)) == 1
    assert [r[1] for r in blob_rows(api)] == [sha(named)]
    assert not store.blob_path(data_dir, sha(old)).exists()
    assert store.blob_path(data_dir, sha(named)).read_bytes() == named
