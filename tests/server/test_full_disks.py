"""Full disks under the control plane, on a real small tmpfs the test fills: the database's (a
write answers 507 saying so, reads still answer, nothing stored is lost, writes work again once
there is room; a blob upload it refused leaves no file), the data dir's (the audit anchor stays
where it was and /readyz says it is behind, until it catches up), and a blob store out of inodes
(507 naming it, in JSON, never a 500)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from harness import Api, small_tmpfs

from computepool.server.app import create_app
from computepool.server.outage import disk_full
from computepool.server.settings import ServerSettings

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")]

A = "/api/v1/allocations"


@pytest.fixture
def small_dir(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "small", "16m") as d:
        yield d


def _fill(path: Path) -> None:
    """Write `path` until the filesystem refuses another byte."""
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 20, 1 << 16, 1 << 12, 1 << 9, 1):
            with contextlib.suppress(OSError):
                while True:
                    try:
                        f.write(b"\0" * size)
                    except OSError as e:
                        if e.errno != errno.ENOSPC:
                            raise
                        break


def test_a_full_database_disk_answers_507_and_loses_nothing(tmp_path: Path, small_dir: Path) -> None:
    db = small_dir / "pool.db"
    settings = ServerSettings(data_dir=tmp_path / "data", db_url=f"sqlite:///{db}")
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        api = Api(client.app, client, settings)  # type: ignore[arg-type]
        first = api.post(A, json={"cpu_milli": 100, "env": {"K": "kept"}}, headers=api.admin)
        assert first.status_code == 201, first.text
        with sqlite3.connect(db) as conn:  # start the write-ahead log empty: a write must grow it
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        _fill(small_dir / "filler")
        big = {f"V{i}": "x" * 8000 for i in range(64)}  # more than any page the log still holds
        r = api.post(A, json={"cpu_milli": 100, "env": big}, headers=api.admin)
        assert r.status_code == 507, r.text
        assert "out of disk space" in r.json()["error"] and r.headers["Retry-After"]
        listed = api.get(A, headers=api.admin)  # reads still answer
        assert listed.status_code == 200 and [a["id"] for a in listed.json()["items"]] == [first.json()["id"]]
        (small_dir / "filler").unlink()  # an operator makes room: writes work again
        again = api.post(A, json={"cpu_milli": 100, "env": big}, headers=api.admin)
        assert again.status_code == 201, again.text
        got = api.get(f"{A}/{first.json()['id']}", headers=api.admin)
        assert got.status_code == 200 and got.json()["env"] == {"K": "kept"}


def _readyz_audit(api: Api, want: str) -> dict[str, str]:
    deadline = time.monotonic() + 60  # the watcher looks once a second; a busy host may be slow
    while True:
        body: dict[str, str] = api.get("/readyz").json()
        if body.get("audit") == want or time.monotonic() > deadline:
            return body
        time.sleep(0.1)


def test_a_full_data_dir_holds_the_audit_anchor_back_and_readyz_says_so(
    tmp_path: Path, small_dir: Path
) -> None:
    settings = ServerSettings(data_dir=small_dir, db_url=f"sqlite:///{tmp_path / 'pool.db'}")
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        api = Api(client.app, client, settings)  # type: ignore[arg-type]
        assert _readyz_audit(api, "intact")["audit"] == "intact"
        anchor = settings.audit_anchor_path.read_text()
        _fill(small_dir / "filler")
        assert api.post("/api/v1/tenants", json={"name": "t1"}, headers=api.admin).status_code == 201
        body = _readyz_audit(api, "anchor-behind")
        assert body["audit"] == "anchor-behind", body
        assert "the head is at seq" in body["audit_error"] and "No space left" in body["audit_error"]
        assert settings.audit_anchor_path.read_text() == anchor  # the old anchor, whole
        assert not list(small_dir.glob("*.tmp"))  # and no half-written one
        (small_dir / "filler").unlink()
        assert _readyz_audit(api, "intact")["audit"] == "intact"
        assert settings.audit_anchor_path.read_text() != anchor  # it moved to the new head
        assert api.get("/api/v1/audit/verify", headers=api.admin).json()["ok"] is True


def test_a_full_database_keeps_no_blob_file_for_an_upload_it_refused(tmp_path: Path, small_dir: Path) -> None:
    db = small_dir / "pool.db"
    blobs = tmp_path / "blobs"  # room for the bytes; none for the row that would hold them
    settings = ServerSettings(data_dir=tmp_path / "data", db_url=f"sqlite:///{db}", blob_dir=blobs)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        api = Api(client.app, client, settings)  # type: ignore[arg-type]
        with sqlite3.connect(db) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        _fill(small_dir / "filler")
        data = os.urandom(64 * 1024)
        r = api.put(f"/api/v1/blobs/{hashlib.sha256(data).hexdigest()}", content=data, headers=api.admin)
        assert r.status_code == 507, r.text
        assert "database is out of disk space" in r.json()["error"]
        assert [p for p in blobs.rglob("*") if p.is_file()] == []  # no file without a row to hold it


def test_a_blob_store_out_of_inodes_answers_507_naming_it(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "blobs", "16m", inodes=64) as blobs:
        settings = ServerSettings(data_dir=tmp_path / "data", blob_dir=blobs)
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            api = Api(client.app, client, settings)  # type: ignore[arg-type]
            first = b"first"
            assert api.put(f"/api/v1/blobs/{hashlib.sha256(first).hexdigest()}", content=first,
                           headers=api.admin).status_code == 201  # fmt: skip
            spare = blobs / "spare"
            spare.mkdir()
            with contextlib.suppress(OSError):  # every inode taken ...
                for i in range(1000):
                    (spare / str(i)).touch()
            (spare / "0").unlink()  # ... but one: the upload's temp file, not its directory
            data = b"second"
            sha = hashlib.sha256(data).hexdigest()
            assert sha[:2] != hashlib.sha256(first).hexdigest()[:2]
            r = api.put(f"/api/v1/blobs/{sha}", content=data, headers=api.admin)
            assert r.status_code == 507, r.text
            assert r.headers["content-type"] == "application/json" and r.headers["Retry-After"]
            assert r.json()["error"].startswith("the server's blob store (--blob-dir) is out of disk space")
            assert not list((blobs / "tmp").iterdir())  # the temp file went
            assert api.head(f"/api/v1/blobs/{sha}", headers=api.admin).status_code == 404


def test_a_sqlite_io_error_on_a_full_disk_counts_as_full(small_dir: Path) -> None:
    """A connection that must make its `-shm` on a full disk gets "disk I/O error", not "full"."""
    db = small_dir / "p.db"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t (x)")
    _fill(small_dir / "filler")
    with pytest.raises(sqlite3.OperationalError) as caught, contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("SELECT * FROM t")
    assert caught.value.sqlite_errorcode & 0xFF == 10  # SQLITE_IOERR (here _SHMSIZE)
    assert disk_full(caught.value, db) and not disk_full(caught.value)  # the disk beside it says why
    (small_dir / "filler").unlink()
    assert not disk_full(caught.value, db)  # the same error with room to spare: not a full disk
