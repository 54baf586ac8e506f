"""A tenant's exec sessions cannot take the node's last free pids.

Each `cpool exec` or `cpool forward` session holds about six of the agent's threads and a process,
and it is served as soon as it is asked for, whether or not the user ever dials in. The control
plane allowed 64 per job, and nothing per tenant: B's 64 sessions into each of a few dozen small
jobs on one node took thousands of the agent's threads, which no job's limit counts (a host of
`kernel.pid_max` 32768 keeps a quarter of it out of the jobs' reach). A node now serves at most 64
sessions of one tenant at a time and refuses more in one line; other tenants' sessions are served.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest
from e2e_helpers import cpool, wait_for
from job_node import Node, job_node

from computepool.agent.relay import MAX_SESSIONS_PER_TENANT

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="tenant users and namespaces need a root agent"),
    pytest.mark.skipif(shutil.which("slirp4netns") is None, reason="a job's own network needs slirp4netns"),
]


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with job_node() as n:
        yield n


def test_a_tenants_sessions_are_capped_per_node_and_anothers_still_served(node: Node) -> None:
    tenant_a, a = node.member("sa")
    tenant_b, b = node.member("sb")
    jobs = {c: node.submit(c, ["sleep", "300"]) for c in (a, b)}
    job_b2 = node.submit(b, ["sleep", "300"])
    for c, alloc in [*jobs.items(), (b, job_b2)]:
        active = lambda c=c, i=alloc: c.get(f"/api/v1/allocations/{i}").json()["state"] == "active"  # noqa: E731
        wait_for(f"job {alloc}", active, 60, node.logs)
    ids = []
    for _ in range(MAX_SESSIONS_PER_TENANT):  # never dialed by B: the node serves them all the same
        r = b.post(f"/api/v1/allocations/{jobs[b]}/relays", json={"kind": "exec", "command": ["sleep", "60"]})
        assert r.status_code == 201, r.text
        ids.append(r.json()["id"])
    log = node.root / "agent.log"
    wait_for(
        "B's sessions served",
        lambda: sum(f"relay session {i}: exec in" in log.read_text() for i in ids) == len(ids),
        60,
        node.logs,
    )
    r = subprocess.run(
        cpool("exec", str(job_b2), "--", "echo", "served"),
        capture_output=True,
        env=node.cli_env(tenant_b),
        timeout=60,
    )
    err = r.stderr.decode()
    assert r.returncode != 0 and r.stdout == b"", (r.stdout, err)
    assert (
        f"the most a tenant may have ({MAX_SESSIONS_PER_TENANT})" in err
        and len(err.strip().splitlines()) == 1
    )
    r = subprocess.run(
        cpool("exec", str(jobs[a]), "--", "echo", "served"),
        capture_output=True,
        env=node.cli_env(tenant_a),
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout == b"served\n", r.stderr
