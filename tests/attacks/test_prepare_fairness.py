"""One tenant's slow job inputs cannot hold up another tenant's job starts on a node.

Before a job starts, its node fetches its code, pulls its image and unpacks the code as the tenant,
on a few worker threads; an unpack of an archive of GiBs (or a slow pull) takes minutes. The
workers took these tasks in the order they came: a tenant with many jobs bound to the node (tiny
ones, each with code of its own) held another tenant's job start behind every one of them. The
workers now take the tenants' tasks in turn. Here one worker and B's unpacks are held on a gate.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from computepool.agent.api import AgentApi
from computepool.agent.assignment import Assignment
from computepool.agent.blobs import BlobCache
from computepool.agent.executor import Executor
from computepool.agent.preparing import PREPARING, Preparer
from computepool.core.tarsafe import sha256_hex


def attempt(alloc: str, tenant: str, code: str) -> Assignment:
    return Assignment(
        allocation_id=alloc, attempt=1, term=1, tenant=tenant, slices=[], command=["true"], env={},
        isolation="", cpu_milli=0, memory_mib=0, code=code,
    )  # fmt: skip


@pytest.fixture
def executor(tmp_path: Path) -> Iterator[Executor]:
    ex = Executor(tmp_path / "agent", cgroup_base=None, kill_grace_s=1.0)
    yield ex
    ex.state.close()


def test_a_tenants_queued_unpacks_do_not_hold_up_anothers_start(executor: Executor, tmp_path: Path) -> None:
    cache = BlobCache(tmp_path / "agent", AgentApi("http://127.0.0.1:9", timeout_s=1))
    cache.dir.mkdir(parents=True, exist_ok=True)
    gate, order = threading.Event(), []

    def unpack(a: Assignment) -> None:  # the unpack step, as slow as B's archives make it
        order.append(a.allocation_id)
        if a.tenant == "b":
            assert gate.wait(30)

    prep = Preparer(lambda: cache, executor.launcher, lambda: None, workers=1, unpack=unpack)
    codes = {}
    for alloc in ("1", "2", "3", "4", "5"):
        data = f"code of {alloc}".encode()
        codes[alloc] = sha256_hex(data)
        cache.path(codes[alloc]).write_bytes(data)  # fetched already: only the unpack is left
    b_attempts = [attempt(i, "b", codes[i]) for i in ("1", "2", "3", "4")]
    a_attempt = attempt("5", "a", codes["5"])
    assert prep.check(b_attempts[0]) == PREPARING
    deadline = time.monotonic() + 20
    while order != ["1"] and time.monotonic() < deadline:
        time.sleep(0.01)
    # B's first is taken before the rest arrive (a busy host's worker may well be that quick):
    # B's next three still wait behind A's one, though they came first
    for x in [*b_attempts[1:], a_attempt]:
        assert prep.check(x) == PREPARING
    gate.set()  # B's first unpack ends: the next turn is A's, not B's next three
    while prep.check(a_attempt) == PREPARING and time.monotonic() < deadline:
        time.sleep(0.01)
    assert order[:2] == ["1", "5"], order
    prep.close()
