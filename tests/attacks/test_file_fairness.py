"""One tenant's file requests cannot hold up another's on a node.

A node packs the files `cpool cp` and `cpool run --output` ask for with GNU tar and gzip, each
request for up to ten minutes of CPU. A job makes a file of 4 TiB in an instant (`truncate`: a
sparse file, no disk used) whose zeros gzip to almost nothing, so packing it runs into that limit.
All the node's requests waited in one queue: B's few requests for it held A's `cpool cp` of a
small file for an hour or more (its request failing unanswered after ten minutes). Each tenant's
requests now have a queue of their own.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
from collections.abc import Iterator

import httpx
import psutil
import pytest
from e2e_helpers import wait_for
from job_node import Node, job_node

from computepool.agent.tenants import user_name

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent"),
    pytest.mark.skipif(shutil.which("truncate") is None, reason="coreutils truncate is needed"),
]


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with job_node() as n:
        yield n


def _packers(tenant: str, names: tuple[str, ...]) -> list[psutil.Process]:
    """The processes of these names the node runs as the tenant's user (its tar and gzip)."""
    uid = pwd.getpwnam(user_name(tenant)).pw_uid
    return [
        p
        for p in psutil.process_iter(["uids", "name"])
        if p.info["uids"] is not None and p.info["uids"].real == uid and p.info["name"] in names
    ]


def _kill_packing(tenant: str) -> None:
    """The tar and gzip the node still runs as B's user (they would run on for minutes)."""
    for p in _packers(tenant, ("tar", "gzip")):
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)


def test_a_tenants_slow_file_requests_do_not_hold_up_anothers(node: Node) -> None:
    tenant_a, a = node.member("fa")
    tenant_b, b = node.member("fb")
    job_b = node.submit(b, ["sh", "-c", "truncate -s 4T big"])
    job_a = node.submit(a, ["sh", "-c", "echo result > small"])
    for client, job in ((b, job_b), (a, job_a)):
        assert node.ended(client, job)["state"] == "released"
    held: list[httpx.Response] = []
    try:
        held += [b.post(f"/api/v1/allocations/{job_b}/files", json={"path": "big"}) for _ in range(2)]
        assert all(r.status_code == 201 for r in held), [r.text for r in held]
        first_b = held[0].json()["id"]
        wait_for("B's packing to start", lambda: _packers(tenant_b, ("tar",)), 30, node.logs)
        r = a.post(f"/api/v1/allocations/{job_a}/files", json={"path": "small"})
        assert r.status_code == 201, r.text
        rid = r.json()["id"]

        def answered() -> dict[str, str] | None:
            got = a.get(f"/api/v1/allocations/{job_a}/files/{rid}", params={"wait": 5}).json()
            return dict(got) if got["state"] != "pending" else None

        got = wait_for("A's file", answered, 90, node.logs)
        assert got["state"] == "done", got
        # B's first request is still being packed: A's did not wait behind it
        assert b.get(f"/api/v1/allocations/{job_b}/files/{first_b}").json()["state"] == "pending"
    finally:

        def b_ended() -> bool:  # each killed pack fails its request and the next one starts
            _kill_packing(tenant_b)
            states = [
                b.get(f"/api/v1/allocations/{job_b}/files/{r.json()['id']}").json()["state"] for r in held
            ]
            return "pending" not in states

        wait_for("B's requests to end", b_ended, 30, node.logs)
