"""A full blob store: an upload that meets ENOSPC is answered 507 naming the store, leaves nothing
half-written, and what was stored before is still there (a real 1 MiB tmpfs as the blob dir)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import small_tmpfs

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")]

B = "/api/v1/blobs"


@pytest.fixture
def small_dir(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "blobs", "1m") as d:
        yield d


def test_a_full_blob_store_answers_507_and_keeps_what_it_had(
    make_api: Callable[..., Any], small_dir: Path
) -> None:
    api = make_api(blob_dir=small_dir)
    api.tenant("t")
    who = api.user("u", "t", "member")
    kept = os.urandom(300 * 1024)
    assert api.put(f"{B}/{hashlib.sha256(kept).hexdigest()}", content=kept, headers=who).status_code == 201
    big = os.urandom(2 * 1024 * 1024)  # more than the disk has left
    r = api.put(f"{B}/{hashlib.sha256(big).hexdigest()}", content=big, headers=who)
    assert r.status_code == 507, r.text
    assert r.json()["field"] == "body" and "the blob store is full" in r.json()["error"]
    held = [p for p in small_dir.rglob("*") if p.is_file()]
    assert [p.stat().st_size for p in held] == [len(kept)], held  # no partial file left behind
    got = api.get(f"{B}/{hashlib.sha256(kept).hexdigest()}", headers=who)
    assert got.status_code == 200 and got.content == kept
    again = os.urandom(100 * 1024)  # room again: uploads work
    assert api.put(f"{B}/{hashlib.sha256(again).hexdigest()}", content=again, headers=who).status_code == 201
