"""Full disks under the control plane, on a real small tmpfs the test fills: the database's (a
write answers 507 saying so, reads still answer, nothing stored is lost, writes work again once
there is room) and the data dir's (the audit anchor stays where it was and /readyz says it is
behind, until it catches up)."""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from harness import Api, small_tmpfs

from computepool.server.app import create_app
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
