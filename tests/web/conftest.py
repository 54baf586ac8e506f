"""Dashboard test fixtures: a real `cpool server` (plain HTTP) for the session tests, and the API
as its admin."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "client"))
from poolkit import PoolServer, start_server  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolServer]:
    with start_server(tmp_path_factory.mktemp("pool")) as s:
        yield s


@pytest.fixture(scope="module")
def admin(server: PoolServer) -> Iterator[httpx.Client]:
    """The API as the bootstrap admin, with a bearer token (no cookie)."""
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}, timeout=10
    ) as c:
        yield c
