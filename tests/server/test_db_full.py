"""A database whose disk is full: a write is answered 507 saying so (not 500, not a plain 503),
reads still answer, nothing stored before is lost, and writes work again once there is room. The
SQLite file lives on a real small tmpfs that the test fills."""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from harness import Api

from computepool.server.app import create_app
from computepool.server.settings import ServerSettings

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")]

A = "/api/v1/allocations"


@pytest.fixture
def small_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "db"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


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
