"""A job's command names a file in another tenant's work dir, to learn whether it is there.

The node looked a job's command up as root before it started the sandbox: a command that root
could run went on to the sandbox (the allocation became active, then failed 127 as the tenant
could not run it), one that root could not find failed at once, never active. So tenant B learnt,
for any name, whether an executable file of that name lay in tenant A's work dir (0700, A's user),
its cache or anywhere else on the node only root may look. A command is now looked up only as the
tenant, in the sandbox: both fail alike.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_helpers import wait_for
from job_node import Node, job_node

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="tenant users need a root agent")]


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with job_node() as n:
        yield n


def _seen(job: dict[str, Any], path: str) -> tuple[Any, ...]:
    """What B sees of its job, the command's path written as <cmd>."""
    return (
        job["state"],
        job["exit_code"],
        str(job["reason"]).replace(path, "<cmd>"),
        [e["state"] for e in job["events"]],
        job["started_at"] is None,
    )


def test_a_command_in_another_tenants_work_dir_fails_like_a_missing_one(node: Node) -> None:
    _, a = node.member("la")
    _, b = node.member("lb")
    tool = f"tool-{uuid.uuid4().hex[:8]}"
    script = f"printf '#!/bin/sh\\necho hi\\n' > {tool}; chmod 700 {tool}; echo ready; sleep 600"
    victim = node.submit(a, ["/bin/sh", "-c", script])
    wait_for(
        "A's job",
        lambda: "ready" in a.get(f"/api/v1/allocations/{victim}/logs").json()["stdout"]["data"],
        60,
        node.logs,
    )
    work = node.agent_dir / "runs" / str(victim) / "1" / "work"
    assert (work / tool).is_file()  # there, and executable by root
    there, missing = str(work / tool), str(work / f"no-{tool}")
    seen_there = _seen(node.ended(b, node.submit(b, [there])), there)
    seen_missing = _seen(node.ended(b, node.submit(b, [missing])), missing)
    assert seen_there == seen_missing, (seen_there, seen_missing)
    name = node.admin.get("/api/v1/nodes").json()["items"][0]["name"]
    assert seen_there[:3] == ("failed", 127, f"failed on {name}: command not found: <cmd>"), seen_there
    assert a.get(f"/api/v1/allocations/{victim}").json()["state"] == "active"
    assert a.post(f"/api/v1/allocations/{victim}/cancel").status_code == 200
